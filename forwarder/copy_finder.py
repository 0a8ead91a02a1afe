"""The engine's `CopyFinder` on RocketMQ: which stored records already have a copy on their target
topics, asked before the engine sends again what a crash, a takeover or a failed send left
ambiguous (`timewheel._recovery`).

Every delivered copy carries a UNIQ_KEY derived from its original id and due time
(`record_encoding.delivered_ids`), the same on every replica and every attempt, and brokers index
`topic#UNIQ_KEY`. So a look-up (`forwarder.rocketmq.MessageLookup`, exact key match) finds a copy
whoever sent it. Two things make "no copy" trustworthy:
- a barrier: indexing is one thread per broker, in commit-log order. A sentinel message sent to a
  broker (`dedupe_sentinel_topic`, one queue on every broker) after the writes in question, once
  found in its index, proves that everything that broker stored before it is indexed too;
- every broker must answer: one that cannot (down, restarting, no master), or a broker seen serving
  the topic that the route no longer lists, leaves its keys unknown (the engine waits and asks
  again), never missing. The NameServer drops a killed broker from the route at once, so the
  brokers seen serving each topic (in the delivery producer's routes, `note_route`, and in the
  look-ups' own) are remembered in the data directory across restarts (`forwarder._served_brokers`).
Brokers must keep their index across a crash (`messageIndexSafe=true`): `index_settings` reads what
each broker says, and `status()` warns about the ones that do not.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from forwarder._served_brokers import SERVED_BROKERS_FILE, ServedBrokers
from forwarder.config import RocketMQConfig
from forwarder.record_encoding import delivered_ids
from forwarder.rocketmq import (Copy, LookupState, MessageLookup, OutgoingMessage, Receipt, RemotingError,
                                RemotingProducer, broker_config)
from storage import RecordBytes, no_answers
from timewheel.message import CopyCheck

if TYPE_CHECKING:
    from forwarder.delivery import RocketMQSink

__all__ = ["BrokerCopyFinder", "INDEX_SLACK_MS", "UNPROVEN_SETTLE_MS"]

log = logging.getLogger("timewheel.dedupe")

#: the index keeps whole seconds: a window begins this much earlier than the earliest send
INDEX_SLACK_MS = 2000
_BARRIER_TIMEOUT_S = 10.0
#: a broker without the sentinel topic is trusted this long after the writes (indexing lags by ms)
UNPROVEN_SETTLE_MS = 5000


class BrokerCopyFinder:
    """Looks stored records up on their target topics' brokers; thread-safe (one barrier at a time)."""

    def __init__(self, cfg: RocketMQConfig, now_ms: Callable[[], int], *, lookup: MessageLookup | None = None,
                 producer: RemotingProducer | None = None, data_dir: Path | None = None,
                 delivery: RocketMQSink | None = None) -> None:
        """Connects lazily; `lookup` and `producer` (for the sentinels) are made from `cfg` unless given;
        `data_dir`: the engine's, where the brokers seen serving each topic are remembered (None: in
        this process only, and a look-up right after a start trusts the route it finds); `delivery`:
        the engine's sink, whose routes are remembered as it looks them up."""
        self.cfg = cfg
        self.quiet_ms = cfg.dedupe_quiet_ms
        self.clock_skew_ms = cfg.dedupe_clock_skew_ms
        self.sentinel_topic = cfg.dedupe_sentinel_topic
        self.now_ms = now_ms
        self._lookup = lookup or MessageLookup(cfg.namesrv, timeout_ms=cfg.send_timeout_ms, security=cfg.security())
        self._producer = producer or RemotingProducer(cfg.namesrv, cfg.producer_group, timeout_ms=cfg.send_timeout_ms,
                                                      security=cfg.security())
        self._barrier_lock = threading.Lock()
        self._proven: dict[str, int] = {}  # broker name -> when (engine clock) its last proven sentinel was sent
        self.served = ServedBrokers(None if data_dir is None else Path(data_dir) / SERVED_BROKERS_FILE)
        if delivery is not None:
            delivery.watch_routes(self.note_route)
        self._addrs: dict[str, str] = {}  # broker name -> address
        self._settings: dict[str, dict[str, str] | str] = {}  # broker name -> its index settings, or why unknown
        self.counters = {"barriers": 0, "barrier_failures": 0, "lookups": 0}

    # ---- the CopyFinder protocol --------------------------------------------------------------------------

    def find_copies(self, records: RecordBytes, sent_from_ms: int, written_before_ms: int) -> CopyCheck:
        """Per record, whether its target holds a copy sent at or after `sent_from_ms`."""
        n = len(records)
        found = np.zeros(n, bool)
        unknown = np.zeros(n, bool)
        answers = no_answers(n)
        errors: list[str | None] = [None] * n
        ids = delivered_ids(records, lambda k: [""] * k)  # no id of its own: nothing to find, sent as missing
        begin = max(1, sent_from_ms - INDEX_SLACK_MS)
        end = self.now_ms() + self.clock_skew_ms + INDEX_SLACK_MS
        rows_of: dict[str, list[int]] = {}
        for i, topic in enumerate(records.topics()):
            if ids[i]:
                rows_of.setdefault(topic, []).append(i)
        for topic, rows in rows_of.items():
            why_not_proven = self._brokers_ready(topic, written_before_ms)
            if isinstance(why_not_proven, str):
                for i in rows:
                    unknown[i], errors[i] = True, why_not_proven
                continue
            answered = self._lookup.lookup(topic, [ids[i] for i in rows], begin, end)
            self.counters["lookups"] += len(rows)
            for i in rows:
                got = answered[ids[i]]
                if got.state is LookupState.FOUND:
                    found[i] = True
                    _answer(answers, i, got.copies[0], self._addrs.get(got.copies[0].broker, ""))
                elif got.state is LookupState.UNKNOWN or why_not_proven:
                    unknown[i] = True
                    errors[i] = "; ".join(got.errors) or "; ".join(why_not_proven)
        return CopyCheck(found, unknown, answers, errors)

    # ---- the brokers -------------------------------------------------------------------------------------

    def note_route(self, topic: str, brokers: Iterable[str]) -> None:
        """Remember that `brokers` serve `topic` (the delivery producer's routes: `RocketMQSink.watch_routes`)."""
        self.served.note(topic, brokers)

    def _brokers_ready(self, topic: str, written_before_ms: int) -> list[str] | str:
        """Make sure every broker of `topic` has indexed what it stored before `written_before_ms`: the
        brokers that could not be proven (why, one entry each); a str when the topic's route itself failed."""
        try:
            brokers = self._lookup.brokers(topic)
        except RemotingError as e:
            return f"the route of {topic}: {type(e).__name__}: {e}"
        self.served.note(topic, brokers)
        self._addrs.update(brokers)
        return self.served.problems(topic, brokers) + self._barrier(sorted(brokers), written_before_ms)

    def _barrier(self, brokers: Sequence[str], written_before_ms: int) -> list[str]:
        """Send a sentinel to each broker not proven since `written_before_ms` and wait until each is
        found in its broker's index; why each broker that could not be proven was not."""
        with self._barrier_lock:
            need = [b for b in brokers if self._proven.get(b, 0) < written_before_ms]
            if not need:
                return []
            for b in need:
                self._check_index_settings(b)
            sent_at = self.now_ms()
            self.counters["barriers"] += 1
            try:
                routed = set(self._lookup.brokers(self.sentinel_topic))
                receipts = self._producer.send_to_every_queue(OutgoingMessage(self.sentinel_topic, b"sentinel"))
            except RemotingError as e:
                self.counters["barrier_failures"] += 1
                return [f"sentinel to {self.sentinel_topic}: {type(e).__name__}: {e}"]
            keys = {r.broker: r.msg_id for r in receipts if isinstance(r, Receipt) and r.broker in need}
            problems = []
            for b in need:
                if b in keys:
                    continue
                if b not in routed and self.now_ms() >= written_before_ms + UNPROVEN_SETTLE_MS:
                    # no queue of the sentinel topic there (a configuration gap, warned about): its index
                    # is trusted once far longer than indexing takes has passed since the writes
                    continue
                problems.append(f"broker {b}: no sentinel stored on it" + ("" if b in routed else
                                f" ({self.sentinel_topic} has no queue there; trusted {UNPROVEN_SETTLE_MS} ms "
                                f"after the writes)"))
            waiting = dict(keys)
            deadline = time.monotonic() + _BARRIER_TIMEOUT_S
            while waiting and time.monotonic() < deadline:
                answered = self._lookup.lookup(self.sentinel_topic, list(waiting.values()), sent_at - 60_000,
                                               sent_at + 60_000 + self.clock_skew_ms)
                for b, key in list(waiting.items()):
                    if any(c.broker == b for c in answered[key].copies):
                        self._proven[b] = sent_at
                        del waiting[b]
                if waiting:
                    time.sleep(0.005)
            problems += [f"broker {b}: its sentinel was not indexed within {_BARRIER_TIMEOUT_S:.0f} s" for b in waiting]
            if problems:
                self.counters["barrier_failures"] += 1
            return problems

    def _check_index_settings(self, broker: str) -> None:
        """Read once what the broker says of its index; warn when it may lose entries in a crash."""
        if isinstance(self._settings.get(broker), dict):
            return
        addr = self._addrs.get(broker, "")
        try:
            conf = broker_config(addr, self._lookup.timeout, self.cfg.security())
        except (RemotingError, OSError) as e:
            self._settings[broker] = f"{type(e).__name__}: {e}"
            return
        self._settings[broker] = {k: conf.get(k, "") for k in ("messageIndexEnable", "messageIndexSafe")}
        if conf.get("messageIndexSafe", "false").lower() != "true":
            log.warning("broker %s (%s) does not say messageIndexSafe=true: after it crashes its index may miss "
                        "copies it holds, and the engine would send those again", broker, addr)

    def status(self) -> dict[str, object]:
        """What `timewheel status` shows: counters, each broker's index settings, and warnings (the
        brokers are those of the sentinel topic, which must have a queue on every broker)."""
        warnings: list[str] = []
        try:
            sentinel_brokers = self._lookup.brokers(self.sentinel_topic)
            self.index_settings(sentinel_brokers)
            lacking = sorted(self.served.brokers() - set(sentinel_brokers))
            warnings += [f"broker {b} serves target topics but has no queue of {self.sentinel_topic}: its look-ups "
                         f"wait {UNPROVEN_SETTLE_MS} ms instead of a proof" for b in lacking]
        except RemotingError as e:
            warnings.append(f"the sentinel topic {self.sentinel_topic} cannot be routed ({type(e).__name__}: {e}): "
                            f"create it with a queue on every broker, or look-ups after a crash cannot finish")
        warnings += [f"broker {b} does not say messageIndexSafe=true: duplicates are possible after it crashes"
                    for b, s in sorted(self._settings.items())
                    if isinstance(s, dict) and s.get("messageIndexSafe", "").lower() != "true"]
        warnings += [f"broker {b}: its index settings could not be read: {s}"
                     for b, s in sorted(self._settings.items()) if isinstance(s, str)]
        warnings += [w for w in (self.served.unreadable, self.served.write_error) if w]
        return {**self.counters, "brokers": dict(self._settings), "warnings": warnings}

    def index_settings(self, brokers: dict[str, str]) -> None:
        """Read the index settings of these brokers (name -> address) unless known, for `status()`."""
        with self._barrier_lock:
            self._addrs.update(brokers)
            for b in brokers:
                self._check_index_settings(b)

    def close(self) -> None:
        """Close the look-up's and the sentinel producer's connections."""
        self._lookup.close()
        self._producer.close()


def _answer(answers: np.ndarray, i: int, copy: Copy, addr: str) -> None:
    """Fill answer row `i` from a found copy (its store host from the broker's address)."""
    answers["queue_offset"][i] = copy.queue_offset
    answers["commit_offset"][i] = copy.commit_log_offset
    answers["queue_id"][i] = copy.queue_id
    host, _, port = addr.rpartition(":")
    try:
        answers["store_ip"][i] = np.frombuffer(socket.inet_aton(host), np.uint8)
        answers["store_port"][i] = int(port)
    except (OSError, ValueError):
        pass  # not an IPv4 address: the row says where in the queue, not the broker's message id
