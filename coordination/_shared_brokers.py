"""The brokers seen serving each target topic, shared by a shard's replicas through ZooKeeper.

Only the lease holder sends, so only its data directory learns which brokers its copies went to
(`dedupe-brokers.txt`, `forwarder._served_brokers`). A standby that takes over while one of them is
down must still know it, or its first look-up asks only the brokers in the route and calls the copies
on the down one missing (sent again: a duplicate once it is back). So the holder publishes what its
directory remembers, and every other replica adds what it reads to its own: at each round while it
follows, and once more when it takes over, before it may send.

Layout: `<shard>/dedupe-brokers` holds JSON `{"replica": R, "epoch": E, "parts": P}`, written after
its children; each child `part-<k>-of-<P>` holds a JSON array of the file's rows, `[broker, topic,
...]` (the array form of `storage.broker_rows`, docs/FORMAT.md), and a topic's rows go to part
crc32(topic) mod P, P the smallest power of two that keeps every part under `PART_BYTES` (ZooKeeper
refuses a znode of about 1 MiB). Writers only add: a part is rewritten with what it held plus what
is new, by compare-and-set, so an old holder writing late cannot take a broker from its successor;
parts of a smaller P stay (still true: a reader adds up every part, and what they hold is in the new
ones too). A part nobody can read is written over at the
holder's next write (emptied, when of another P).
Nothing is forgotten by itself, as in the file: a broker gone for good is deleted from every
replica's file and then this znode (docs/HA.md).

The holder writes when its directory learns a broker, when it takes over, and when the document is
not the one it wrote last (deleted by an operator, written by an old holder), and may not send from
the moment a broker is learnt until it is written (`settled`): a copy never goes to a broker its
successor could not know of. A follower reads the parts again only when the document's data changed.
A write that fails (refused, a part one topic fills alone, compare-and-sets that keep losing) is tried
again every round and logged once; why is in the replica's status (`dedupe_brokers_unpublished`), and
the failures and the unreadable parts are counted (`counters`), as the replica's counters are. Not for
ever while it holds the sends: failing in a row for `timeout_s` (`ha.dedupe_brokers_publish_timeout_s`,
on the replica's monotonic clock) raises `DedupeBrokersUnpublishedError` out of the replica's loop,
which gives the lease up and stops the service not ready. A repair write that fails while sends go on
(what it learnt was published before) is retried with no end: nothing is held meanwhile.
"""
from __future__ import annotations

import json
import logging
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, KazooException, NodeExistsError, NoNodeError
from kazoo.handlers.threading import KazooTimeoutError

from coordination.config import HAConfig
from coordination.errors import DedupeBrokersUnpublishedError
from storage import (BrokerRowsError, broker_pairs_of, broker_rows_of_pairs, broker_topics_of, decode_broker_array,
                     encode_broker_array)

__all__ = ["PART_BYTES", "RememberedBrokers", "SharedBrokers"]

log = logging.getLogger("timewheel.replica")

#: a part is kept under this many bytes (ZooKeeper's default limit, jute.maxbuffer, is 1 MiB less a little)
PART_BYTES = 256 * 1024
#: parts at most: past this, topics whose crc32 agree in their low 16 bits stay together anyway
_MAX_PARTS = 1 << 16
_WRITE_TRIES = 5


class _PartTooLarge(ValueError):
    """A part stays over the size limit however many parts there are (one topic's brokers fill it)."""


class RememberedBrokers(Protocol):
    """What a data directory remembers of the brokers that served its target topics (`ServedBrokers`)."""

    def snapshot(self) -> dict[str, set[str]]:
        """Target topic -> its brokers."""
        ...

    def note_all(self, topics: Mapping[str, Iterable[str]]) -> None:
        """Remember more brokers of more topics."""
        ...

    def watch(self, on_new: Callable[[], None]) -> None:
        """Call `on_new()` whenever a broker new for a topic is remembered, before the call that noted it returns."""
        ...


class SharedBrokers:
    """One replica's side of the shard's shared brokers: publishes them while it holds, follows them otherwise."""

    def __init__(self, remembered: RememberedBrokers, shard_path: str, replica_id: str, wake: Callable[[], None],
                 *, part_bytes: int = PART_BYTES, monotonic: Callable[[], float] = time.monotonic,
                 timeout_s: float = HAConfig.dedupe_brokers_publish_timeout_s) -> None:
        """`wake`: called when a broker is learnt, so that the replica's thread publishes it at once;
        `timeout_s`: how long writes may fail in a row while they hold the sends before `publish` gives up."""
        self.remembered = remembered
        self.path = f"{shard_path}/dedupe-brokers"
        self.replica_id = replica_id
        self.part_bytes = part_bytes
        self._wake = wake
        self._lock = threading.Lock()
        # brokers learnt (counted as the directory tells), and of those the ones the last write covered:
        # what the directory knew before is published once too, before this replica's first send
        self._learnt, self._published = 1, 0
        self._written: int | None = None  # the document's mzxid after this replica's last write
        self._read: int | None = None  # the document's mzxid when this replica last read the parts
        self.reads = 0  # times the parts were read
        self.failure: str | None = None  # why this holder's last write failed, until one succeeds (logged once)
        self._failed_rounds = 0  # writes failed in a row
        self._monotonic = monotonic
        self.timeout_s = timeout_s
        self._held_since: float | None = None  # the first of the failures in a row that hold the sends
        self.publish_failures = 0  # writes that failed (each round retries)
        #: the parts the last read could not read: name -> (why, its version, for a compare-and-set over it)
        self._unreadable: dict[str, tuple[str, int]] = {}
        self.unreadable_parts = 0  # parts found unreadable (a part counts again only when written again)
        remembered.watch(self._on_new)

    def _on_new(self) -> None:
        with self._lock:
            self._learnt += 1
        self._wake()

    def settled(self) -> bool:
        """False from the moment a broker is learnt until it is published (the holder may not send meanwhile)."""
        return self._learnt == self._published

    def counters(self) -> dict[str, int]:
        """Writes that failed, parts found unreadable (the replica's counters, `timewheel_ha_*`)."""
        return {"dedupe_brokers_publish_failures": self.publish_failures,
                "dedupe_brokers_unreadable_parts": self.unreadable_parts}

    def status(self) -> dict[str, object]:
        """Why what this holder learnt is not published (None: it is, or it follows), and each part the last
        read could not read (for the replica's status)."""
        return {"dedupe_brokers_unpublished": self.failure,
                "dedupe_brokers_unreadable": [f"{self.path}/{child} cannot be read ({why}): its brokers are left "
                                              f"out until the holder writes over it"
                                              for child, (why, _) in sorted(self._unreadable.items())]}

    def follow(self, client: KazooClient) -> None:
        """Add what the shard's document holds to this replica's directory, if it changed since last read."""
        # a replica that follows writes nothing: a failure of its writes as a holder is over (reported anew next time)
        self.failure, self._failed_rounds, self._held_since = None, 0, None
        stat = client.exists(self.path)
        if stat is None or stat.mzxid in (self._read, self._written):
            return
        # the document's data is written after its parts: read before them, a later write shows as a change
        self.remembered.note_all(self._read_parts(client))
        self._read = stat.mzxid
        self.reads += 1

    def publish(self, client: KazooClient, epoch: int) -> bool:
        """Write what this replica remembers, if it learnt a broker since its last write or the document is
        not its own; False when it could not (ZooKeeper refused, a part too large, other writers kept
        changing the parts): `failure` says why, logged once, and it is tried again next round.
        DedupeBrokersUnpublishedError when writes that hold the sends have failed in a row for `timeout_s`."""
        learnt = self._learnt
        try:
            stat = client.exists(self.path)
            if learnt == self._published and stat is not None and stat.mzxid == self._written:
                return True
            mine = self.remembered.snapshot()
            for _ in range(_WRITE_TRIES):
                client.ensure_path(self.path)
                try:
                    parts = self._write_parts(client, mine)
                except (BadVersionError, NodeExistsError):
                    continue  # another writer changed a part meanwhile: read it again
                doc = {"replica": self.replica_id, "epoch": epoch, "parts": parts}
                self._written = client.set(self.path, json.dumps(doc).encode()).mzxid
                break
            else:
                return self._failed(learnt, f"the parts kept changing under its write, {_WRITE_TRIES} times (another "
                                            f"writer: a deposed holder still running?)")
        except _PartTooLarge as e:
            return self._failed(learnt, str(e))
        except (KazooException, KazooTimeoutError) as e:  # a refusal, or a connection the next round looks at
            what = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            return self._failed(learnt, f"ZooKeeper did not take the write ({what})")
        with self._lock:
            self._published = learnt
        self._unreadable = {}  # every part it could not read was written over
        self._held_since = None
        if self.failure is not None:
            log.info("%s: published after %d failed write(s)", self.path, self._failed_rounds)
            self.failure, self._failed_rounds = None, 0
        return True

    def _failed(self, learnt: int, why: str) -> bool:
        """Count a failed write and say why (logged when the failures begin, not at every round); False, or
        DedupeBrokersUnpublishedError once the failures in a row have held the sends for `timeout_s`."""
        self.publish_failures += 1
        self._failed_rounds += 1
        held = learnt != self._published
        then = (f"this holder sends nothing until they are, for {self.timeout_s:g} s at most" if held else
                "sends go on (what it learnt was published before), but a successor would not know the brokers "
                "the znode lost")
        first = self.failure is None
        self.failure = (f"the brokers this holder's data directory learnt are not published to {self.path}: {why}; "
                        f"{then} (tried again every round)")
        if first:
            log.error("%s", self.failure)
        now = self._monotonic()
        if not held:
            self._held_since = None  # nothing waits on this write: retried with no end
        elif self._held_since is None:
            self._held_since = now
        elif now - self._held_since >= self.timeout_s:
            raise DedupeBrokersUnpublishedError(self.path, now - self._held_since, self.timeout_s, why)
        return False

    def _read_parts(self, client: KazooClient) -> dict[str, set[str]]:
        """Topic -> brokers, from every part (one that cannot be read is counted, reported once and left out)."""
        rows: list[list[str]] = []
        unreadable: dict[str, tuple[str, int]] = {}
        try:
            children = client.get_children(self.path)
        except NoNodeError:
            children = []  # deleted by an operator meanwhile: written again by the holder
        for child in sorted(children):
            try:
                data, stat = client.get(f"{self.path}/{child}")
            except NoNodeError:
                continue  # a part deleted by an operator meanwhile
            try:
                rows += decode_broker_array(data)
            except BrokerRowsError as e:
                unreadable[child] = (str(e), stat.version)
                if self._unreadable.get(child, ("", -1))[1] != stat.version:  # not this version of it before
                    self.unreadable_parts += 1
                    log.error("%s/%s cannot be read (%s): its brokers are left out until the holder writes over it",
                              self.path, child, e)
                continue
        self._unreadable = unreadable
        return broker_topics_of(rows)

    def _write_parts(self, client: KazooClient, mine: Mapping[str, set[str]]) -> int:
        """Add `mine` to the parts (each part's own write a compare-and-set); the number of parts used."""
        held = self._read_parts(client)
        merged = {t: set(bs) for t, bs in held.items()}
        for t, bs in mine.items():
            merged.setdefault(t, set()).update(bs)
        parts = 1
        while True:
            split = _split(merged, parts)
            over = [rows for rows in split if len(encode_broker_array(rows)) > self.part_bytes]
            if not over:
                break
            # more parts cannot help a part that holds one topic only (a topic's rows stay together)
            if parts >= _MAX_PARTS or all(len(broker_topics_of(rows)) == 1 for rows in over):
                worst = max(over, key=lambda rows: len(encode_broker_array(rows)))
                topics, size = ", ".join(sorted(broker_topics_of(worst))), len(encode_broker_array(worst))
                raise _PartTooLarge(
                    f"the brokers of {topics} fill a part alone ({len(worst)} brokers, {size} bytes; a "
                    f"part holds {self.part_bytes}): delete the brokers gone for good from every replica's "
                    f"dedupe-brokers.txt, then this znode (docs/OPERATIONS.md)")
            parts *= 2
        names: set[str] = set()
        for k, rows in enumerate(split):
            names.add(f"part-{k}-of-{parts}")
            path = f"{self.path}/part-{k}-of-{parts}"
            try:
                data, stat = client.get(path)
            except NoNodeError:
                client.create(path, encode_broker_array(rows))
                continue
            try:  # read again: what another writer added since is kept too
                have, readable = broker_pairs_of(decode_broker_array(data)), True
            except BrokerRowsError:
                have, readable = set(), False  # nobody can read it: written over, even with nothing to add
            if not readable or not broker_pairs_of(rows) <= have:
                client.set(path, encode_broker_array(broker_rows_of_pairs(have | broker_pairs_of(rows))),
                           version=stat.version)
        for child, (_, version) in self._unreadable.items():
            if child not in names:  # a part of another count nobody can read: emptied, or it is reported forever
                try:
                    client.set(f"{self.path}/{child}", encode_broker_array([]), version=version)
                except NoNodeError:
                    pass  # deleted by an operator meanwhile
        return parts


def _split(topics: Mapping[str, set[str]], parts: int) -> list[list[list[str]]]:
    """The rows of each part: a topic goes to part crc32(topic) mod `parts`."""
    by_part: list[set[tuple[str, str]]] = [set() for _ in range(parts)]
    for topic, brokers in topics.items():
        by_part[zlib.crc32(topic.encode()) % parts].update((b, topic) for b in brokers)
    return [broker_rows_of_pairs(pairs) for pairs in by_part]
