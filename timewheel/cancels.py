"""Tombstones: cancels kept for a while, so that a message arriving after the cancel naming it is
cancelled too (its replica may read the cancel's queue before the message's).

A tombstone names an id or a business key:
- an id tombstone cancels a message whose id is that id, or whose id starts with it and ':' (the
  engine's ids of delay-topic messages are `<UNIQ_KEY>:<checksum>`; a producer knows the first part);
- a key tombstone cancels every message carrying that key.
Neither depends on the order in which an engine reads the cancel and the message, nor on anyone's
clock, so every replica of a shard reaches the same outcome. A key cancelled stays cancelled for
the retention: a new message under that key within it is cancelled too.

A tombstone screens arrivals from the moment `add()` holds it, and is on disk (`storage.TombstoneLog`)
once `save()` of its cancel returns, which the engine calls after applying that cancel whole to
what is stored: a crash or a failed write in between leaves no tombstone on disk, so the cancel,
not yet acknowledged, is applied whole again when it comes back (pulled again, asked again). It
is forgotten `retention_ms` after it arrived.

At most `max_entries` are held. The policy past that bound is stated, not silent: the oldest
tombstone goes first, before its retention, and each one is counted (`evicted`, exported as
`timewheel_cancel_tombstones_evicted_total`) and logged; an operator alerts on that counter and
raises `max_tombstones`. Refusing new cancels instead would stall every queue they share with
messages, which is worse than forgetting the oldest cancel.
Screening a batch is a few set operations over the batch in C (`isdisjoint`), no Python step per
message unless one matches.
"""
from __future__ import annotations

import logging
import re
import threading
from collections import deque
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter
from typing import Sequence

from storage import Tombstone, TombstoneLog
from storage.tombstones import ID, KEY, MAX_TEXT
from timewheel.message import Message

log = logging.getLogger("timewheel.cancels")
_ids_of = attrgetter("msg_id")
_keys_of = attrgetter("keys")
def producer_id(msg_id: str) -> str:
    """The id a producer's send returned (its UNIQ_KEY) for a message the engine stores as
    `<UNIQ_KEY>:<checksum>`: what comes before the last ':' (a UNIQ_KEY may hold ':' itself); an
    id without one is its own."""
    head, sep, _ = msg_id.rpartition(":")
    return head if sep else msg_id


#: what no message can carry: RocketMQ's separators (\x00-\x02) and U+FFFD (bytes that were not UTF-8)
_UNCARRIED = re.compile("[\x00-\x02\ufffd]")


@dataclass(frozen=True, slots=True)
class CancelRequest:
    """A cancel: exactly one of `msg_id` or `key`, and when it was sent (epoch ms, its producer's clock;
    kept with the tombstone for whoever inspects it).

    The one rule every path (a control message on the delay topic, the admin API, the Python API)
    goes through, so that every replica names the same thing: spaces around the text are dropped;
    the text must then be non-empty, hold nothing a message cannot carry (\\x00-\\x02, text that was
    not UTF-8), fit a tombstone, and a key holds no space (RocketMQ separates keys with spaces, so
    no message carries such a key). Tabs and other characters a message's keys may hold are kept.
    """

    msg_id: str | None
    key: str | None
    born_ms: int

    def __post_init__(self) -> None:
        if (self.msg_id is None) == (self.key is None):
            raise ValueError("a cancel names exactly one non-empty msg_id or key")
        what = "msg_id" if self.key is None else "key"
        raw = self.msg_id if self.key is None else self.key
        if not isinstance(raw, str):
            raise ValueError(f"a cancel's {what} is text, not {type(raw).__name__}")
        text = raw.strip(" ")
        if not text:
            raise ValueError("a cancel names exactly one non-empty msg_id or key")
        if _UNCARRIED.search(text):
            raise ValueError(f"a cancel's {what} {raw!r:.80} holds \\x00-\\x02 or text that was not UTF-8: no "
                             f"message can carry it")
        if what == "key" and " " in text:
            raise ValueError(f"a key holds no space (RocketMQ separates keys with spaces): {raw!r:.80}")
        if len(text.encode("utf-8", "surrogatepass")) > MAX_TEXT:
            raise ValueError(f"a cancel's id or key is at most {MAX_TEXT} bytes of UTF-8")
        object.__setattr__(self, what, text)


def _named(r: CancelRequest) -> tuple[int, str]:
    """What a cancel names, as its tombstone is held: (kind, text)."""
    return (ID, r.msg_id) if r.msg_id is not None else (KEY, r.key or "")


class Tombstones:
    """The engine's tombstones: held in memory, written through to the data directory's log."""

    def __init__(self, log_file: TombstoneLog, retention_ms: int, max_entries: int) -> None:
        """Empty until `load()`; `retention_ms` after its arrival a tombstone is forgotten."""
        self._log = log_file
        self.retention_ms = retention_ms
        self.max_entries = max_entries
        self._lock = threading.Lock()
        self._ids: dict[str, int] = {}  # id -> expires_ms
        self._keys: dict[str, int] = {}  # key -> expires_ms
        self._order: deque[tuple[int, int, str]] = deque()  # (expires_ms, kind, text) in arrival order
        self._on_disk = 0  # entries in the log file, live or not: compaction's trigger
        self._unsaved: dict[tuple[int, str], Tombstone] = {}  # held, not yet in the log file
        #: grows with every tombstone added, so a writer can tell whether one arrived meanwhile
        self.generation = 0
        self.evicted = 0  # tombstones dropped over `max_entries` before their time

    def load(self, now_ms: int) -> int:
        """Read the log (cutting a torn tail), drop what expired; returns corrupt frames skipped."""
        found = self._log.read()
        with self._lock:
            for t in found.tombstones:
                self._hold(t)
            self._on_disk = len(found.tombstones)
            self._expire_locked(now_ms)
        if found.corrupt_frames:
            log.warning("tombstone log %s: %d corrupt frame(s) skipped", self._log.path, found.corrupt_frames)
        return found.corrupt_frames

    def __len__(self) -> int:
        with self._lock:
            return len(self._ids) + len(self._keys)

    def add(self, requests: Sequence[CancelRequest], now_ms: int) -> list[CancelRequest]:
        """Hold cancels as tombstones (screening from now on; on disk once `save()` returns).

        Returns the requests still to be applied to what is stored: those new to this engine, and
        those whose tombstone is not saved yet (their application may not have finished). A repeat
        (the copy from another queue) returns nothing, unless it comes more than 1% of the
        retention later: then it renews the tombstone's retention and is applied again.
        """
        expires = now_ms + self.retention_ms
        renew_after = self.retention_ms // 100
        with self._lock:
            todo: list[CancelRequest] = []
            fresh: list[Tombstone] = []
            seen: set[tuple[int, str]] = set()
            for r in requests:
                kind, text, table = (ID, r.msg_id, self._ids) if r.msg_id is not None else (KEY, r.key, self._keys)
                assert text is not None
                if (kind, text) in seen:
                    continue
                seen.add((kind, text))
                held = table.get(text)
                if held is None or expires - held > renew_after:
                    fresh.append(Tombstone(kind, text, r.born_ms, expires))
                    todo.append(r)
                elif (kind, text) in self._unsaved:
                    todo.append(r)
            for t in fresh:
                self._hold(t)
                self._unsaved[(t.kind, t.text)] = t
            if fresh:
                self.generation += 1
                self._expire_locked(now_ms)
            return todo

    def save(self, now_ms: int, applied: Sequence[CancelRequest]) -> None:
        """Write the tombstones of `applied` (cancels just applied whole) not yet on disk, as one
        frame; raises if the disk fails (they stay unsaved: the next `add` of the same cancel
        applies and saves it again)."""
        with self._lock:
            # Only these: another caller's cancel held meanwhile may be under way or have failed, and
            # once on disk a tombstone reads as applied, so its retry would be skipped as seen.
            pending = [t for n in dict.fromkeys(map(_named, applied)) if (t := self._unsaved.get(n)) is not None]
            if not pending:
                return
            self._log.append(pending, now_ms)
            self._on_disk += len(pending)
            for t in pending:
                del self._unsaved[(t.kind, t.text)]

    def _hold(self, t: Tombstone) -> None:
        table = self._ids if t.kind == ID else self._keys
        table[t.text] = max(t.expires_ms, table.get(t.text, t.expires_ms))
        self._order.append((t.expires_ms, t.kind, t.text))

    def screen(self, messages: Sequence[Message], now_ms: int) -> list[int]:
        """Positions of the messages a tombstone cancels."""
        if not self._ids and not self._keys:  # the usual case, without a list per batch (the lock re-checks)
            return []
        return self.screen_rows(list(map(_ids_of, messages)), list(map(_keys_of, messages)), now_ms)

    def screen_rows(self, msg_ids: Sequence[str | None], keys: Sequence[Sequence[str]], now_ms: int) -> list[int]:
        """Positions of the rows (an id, or None, and business keys each) a tombstone cancels."""
        with self._lock:
            if self._order and self._order[0][0] <= now_ms:
                self._expire_locked(now_ms)
            held_ids, held_keys = self._ids, self._keys
            if not held_ids and not held_keys:
                return []
            if held_ids:
                named = list(filter(None, msg_ids))
                id_hit = not held_ids.keys().isdisjoint(named) or not held_ids.keys().isdisjoint(
                    map(producer_id, named))
            else:
                id_hit = False
            key_hit = bool(held_keys) and not held_keys.keys().isdisjoint(chain.from_iterable(keys))
            if not id_hit and not key_hit:
                return []
            return [i for i, (mid, ks) in enumerate(zip(msg_ids, keys)) if self._cancels(mid, ks)]

    def _cancels(self, msg_id: str | None, keys: Sequence[str]) -> bool:
        if msg_id and (msg_id in self._ids or producer_id(msg_id) in self._ids):
            return True
        return any(k in self._keys for k in keys)

    def expire(self, now_ms: int) -> None:
        """Forget tombstones past their retention (and compact the log when mostly dead)."""
        with self._lock:
            self._expire_locked(now_ms)

    def _expire_locked(self, now_ms: int) -> None:
        order = self._order
        while order and (order[0][0] <= now_ms or len(self._ids) + len(self._keys) > self.max_entries):
            expires, kind, text = order.popleft()
            table = self._ids if kind == ID else self._keys
            if table.get(text) != expires:
                continue  # superseded by a later entry still in the order
            if expires > now_ms:
                self.evicted += 1
                if self.evicted == 1 or self.evicted % 10_000 == 0:
                    log.warning("more than %d tombstones: dropping the oldest before their retention "
                                "(%d so far); raise engine.max_tombstones", self.max_entries, self.evicted)
            del table[text]
        live = len(order)
        if self._on_disk > 2 * live + 1024:
            self._log.rewrite(self._live(), now_ms)
            self._on_disk = len(self._ids) + len(self._keys)

    def _live(self) -> list[Tombstone]:
        # The born times stay in the old file only: nothing reads them back. Unsaved tombstones
        # stay out: on disk, a tombstone says its cancel was applied, and theirs may not be yet.
        unsaved = self._unsaved
        return [*(Tombstone(ID, t, 0, e) for t, e in self._ids.items() if (ID, t) not in unsaved),
                *(Tombstone(KEY, t, 0, e) for t, e in self._keys.items() if (KEY, t) not in unsaved)]

    def flush(self) -> None:
        """fsync the log (every durability mode, at each checkpoint)."""
        with self._lock:
            self._log.flush()

    def close(self) -> None:
        """fsync and close the log file."""
        with self._lock:
            self._log.close()
