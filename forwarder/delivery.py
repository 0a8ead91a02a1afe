"""Delivery: a Sink that sends due messages to their target topics, and the dead-letter path.

Due messages go out through `forwarder.rocketmq.RemotingProducer`: grouped by topic, cut into
SEND_BATCH_MESSAGE requests of up to 128 messages / 1 MiB, each stored by the broker as separate
messages, each under the id its content decides (`contract.delivered_id`): a copy sent again,
by this process or another replica, carries the id of the first. Dead letters are new messages on
a topic of the engine's own and get fresh ids. Dead letters go through the wire client too (a producer of their own,
shared with ingest), so the engine never loads the bundled native client.

Up to `send_threads` batches are in flight at once (`max_in_flight`: the engine runs that many
dispatch threads), each on its own producer and connections, so one slow answer holds up only its
own batch.

A circuit breaker stops hammering a broker that keeps failing: while it is open every batch fails
at once and the engine retries later with backoff; after the open period one batch probes the
broker. Only retriable failures (broker down, busy, timeouts) count towards opening it: a topic
that does not exist or a message the broker refuses says nothing about the broker's health.
"""
from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Collection, Mapping
from contextlib import contextmanager
from dataclasses import replace
from typing import Iterator, Sequence

import numpy as np

from forwarder.contract import (ORIGINAL_MSG_ID, TARGET_TOPIC, ContractViolation, check_target_topic, delivered_id,
                                to_dead_letter, to_outgoing)
from forwarder.rocketmq import EncodedBatches, FencedError, Receipt, RemotingError, RemotingProducer
from forwarder.config import RocketMQConfig
from forwarder.record_batches import cut_records
from storage import RecordBytes, no_answers
from timewheel.message import Message, SendResults

log = logging.getLogger("timewheel.delivery")
_BREAKER_OPEN = "not sent: the circuit breaker is open after consecutive failed sends"


class CircuitBreaker:
    """Opens after `failures` consecutive failed sends; lets a probe through after `open_seconds`."""

    def __init__(self, failures: int, open_seconds: float) -> None:
        self.failures = failures
        self.open_seconds = open_seconds
        self._consecutive = 0
        self._open_until = 0.0
        self._lock = threading.Lock()
        self.opened = 0

    def allow(self) -> bool:
        """Whether a send may go out now."""
        with self._lock:
            return time.monotonic() >= self._open_until

    def record(self, ok: int, failed: int) -> None:
        """Account a batch's outcome."""
        with self._lock:
            if ok:
                self._consecutive = 0
                self._open_until = 0.0
            self._consecutive += failed
            if not ok and self._consecutive >= self.failures and time.monotonic() >= self._open_until:
                self._open_until = time.monotonic() + self.open_seconds
                self.opened += 1
                log.warning("circuit open for %.1fs after %d consecutive failed sends", self.open_seconds,
                            self._consecutive)

    @property
    def is_open(self) -> bool:
        """True while sends are being held back."""
        return not self.allow()


class RocketMQSink:
    """Sends due messages to their target topics; also the engine's dead-letter sink."""

    def __init__(self, cfg: RocketMQConfig, producer: RemotingProducer, *,
                 sender: RemotingProducer | None = None) -> None:
        """Deliver through `cfg.send_threads` RemotingProducers for `cfg` (or through `sender` alone);
        dead letters through `producer` (the caller closes it)."""
        self.cfg = cfg
        self.producer = producer
        self.senders = [sender] if sender is not None else [
            RemotingProducer(cfg.namesrv, cfg.producer_group, timeout_ms=cfg.send_timeout_ms, security=cfg.security())
            for _ in range(cfg.send_threads)]
        self.max_in_flight = len(self.senders)
        self._reserved = frozenset({cfg.delay_topic, cfg.dead_letter_topic})
        self.linger_ms = cfg.send_linger_ms
        self.linger_max_ms = cfg.send_linger_max_ms
        self._idle: queue.SimpleQueue[RemotingProducer] = queue.SimpleQueue()
        for s in self.senders:
            self._idle.put(s)
        self.breaker = CircuitBreaker(cfg.breaker_failures, cfg.breaker_open_seconds)
        # failed counts every message not delivered; rejected, those whose error is not retriable
        self.counters = {"sent": 0, "failed": 0, "refused": 0, "rejected": 0, "dead_lettered": 0}
        self._counters_lock = threading.Lock()

    @property
    def sender(self) -> RemotingProducer:
        """The first producer (route and connection state for tools and tests)."""
        return self.senders[0]

    @contextmanager
    def _checkout(self) -> Iterator[RemotingProducer]:
        sender = self._idle.get()  # never empty for long: at most max_in_flight callers
        try:
            yield sender
        finally:
            self._idle.put(sender)

    def _count(self, **deltas: int) -> None:
        with self._counters_lock:
            for k, v in deltas.items():
                self.counters[k] += v

    def send_batch(self, messages: Sequence[Message]) -> list[bool]:
        """Send every message and wait for all answers; True per stored message.

        A batch request the broker refused or did not answer fails all of its messages; the
        other batches of the call are unaffected.
        """
        if not self.breaker.allow():
            self._count(refused=len(messages))
            return SendResults([False] * len(messages), errors=[_BREAKER_OPEN] * len(messages))
        if not messages:
            return []
        # Only user topics: a message scheduled in process or by backfill is held to the contract too,
        # so that the engine's producer never writes into another group's retry or dead-letter queue.
        allowed = [_user_topic(m.topic, self._reserved) for m in messages]
        if not all(allowed):
            sendable = [m for m, ok in zip(messages, allowed) if ok]
            self._count(failed=len(messages) - len(sendable), rejected=len(messages) - len(sendable))
            log.warning("refused %d message(s) for topics that are not delivery targets: %s",
                        len(messages) - len(sendable), sorted({m.topic for m, ok in zip(messages, allowed) if not ok}))
            sent = iter(self.send_batch(sendable))
            return [next(sent) if ok else False for ok in allowed]
        outgoing = [to_outgoing(m) for m in messages]
        try:
            with self._checkout() as sender:
                outcomes: list[Receipt | RemotingError] = sender.send(outgoing, _ids(messages, sender))
        except RemotingError as e:  # the sender is closed
            outcomes = [e] * len(messages)
        return self._settle(lambda: [m.topic for m in messages], outcomes)

    def send_records(self, records: RecordBytes, extra: Mapping[str, str] | None = None,
                     fence: Callable[[], bool] | None = None) -> list[bool]:
        """`send_batch` for stored records as they are on disk: the batches' bodies are built from
        their bytes in one pass (`record_batches.cut_records`), no object made per message on the way;
        `extra` properties go on every message; `fence` is asked right before the write (see
        `RemotingProducer.send_encoded`): what it stops comes back False, unsent."""
        if not self.breaker.allow():
            self._count(refused=len(records))
            return SendResults([False] * len(records), errors=[_BREAKER_OPEN] * len(records))
        if not len(records):
            return []
        answers = no_answers(len(records))
        by_topic: dict[str, list[int]] | None = None
        sender = self._idle.get()  # never empty for long: at most max_in_flight callers
        try:
            try:
                cut = cut_records(records, sender.new_ids, extra, max_message=sender.max_message_bytes,
                                  max_count=sender.max_batch_messages, max_bytes=sender.max_batch_bytes)
                by_topic = _rows_by_topic(cut)
                allowed = all(_user_topic(t, self._reserved) for t in by_topic)
                outcomes: list[RemotingError | None] = sender.send_batches(cut, fence, answers) if allowed else []
            finally:  # as `_checkout`, without a generator per send
                self._idle.put(sender)
        except RemotingError as e:  # the sender is closed
            allowed, outcomes = True, [e] * len(records)
        if not allowed:
            # rare; the general path says which and why
            return self.send_batch([replace(m, properties={**(m.properties or {}), **(extra or {})})
                                    for m in (Message.from_record(records.record(i)) for i in range(len(records)))])
        return self._settle(records.topics, outcomes, answers, by_topic)

    def _settle(self, topics_of: Callable[[], Sequence[str]], outcomes: Sequence[Receipt | RemotingError | None],
                answers: np.ndarray | None = None, by_topic: dict[str, list[int]] | None = None) -> SendResults:
        """Count a send's outcomes (a Receipt or None: stored), feed the breaker, log each failed request
        once (`topics_of()`: each message's topic); the results carry the broker's answers, each
        failure's error, the rows the fence stopped before their write (`held`) and `by_topic` (each
        topic's rows, as the cut grouped them)."""
        if outcomes.count(None) == len(outcomes):  # the usual answer of send_batches, without a test per message
            self.breaker.record(len(outcomes), 0)
            self._count(sent=len(outcomes))
            return SendResults([True] * len(outcomes), answers, by_topic=by_topic)
        stored = [not isinstance(o, RemotingError) for o in outcomes]
        ok = sum(stored)
        if ok == len(stored):
            self.breaker.record(ok, 0)
            self._count(sent=ok)
            return SendResults(stored, answers, by_topic=by_topic)
        topics = topics_of()
        results = SendResults(stored, answers, [None if s else f"{type(o).__name__}: {o}"
                                                for s, o in zip(stored, outcomes)], by_topic=by_topic)
        errors: dict[int, tuple[str, RemotingError]] = {}  # one entry per failed request, not per message
        retriable = rejected = 0
        fenced = 0
        for topic, o in zip(topics, outcomes):
            if isinstance(o, FencedError):  # never reached a broker: no failure of the broker's
                fenced += 1
                continue
            if isinstance(o, RemotingError):
                errors.setdefault(id(o), (topic, o))
                if o.retriable:
                    retriable += 1
                else:
                    rejected += 1
        if fenced:  # stopped by the fence before the write: nothing reached a broker, no attempt spent
            results.held = np.fromiter((isinstance(o, FencedError) for o in outcomes), bool, len(outcomes))
        self.breaker.record(ok, retriable)
        self._count(sent=ok, failed=len(results) - ok - fenced, rejected=rejected)
        for topic, err in errors.values():
            # Not retriable means a missing topic or a refused message: someone has to act on it.
            log.log(logging.DEBUG if err.retriable else logging.WARNING, "delivery to %s failed (%s): %s", topic,
                    type(err).__name__, err)
        return results

    def watch_routes(self, on_route: Callable[[str, Collection[str]], None]) -> None:
        """Call `on_route(topic, broker names)` with every target route a sender looks up from now on."""
        for s in self.senders:
            s.watch_routes(on_route)

    def close(self) -> None:
        """Close every sender's connections."""
        for s in self.senders:
            s.close()

    def dead_letter(self, messages: Sequence[Message], reason: str) -> None:
        """Park messages on the dead-letter topic with the reason; raises if the broker refuses."""
        letters = []
        for m in messages:
            props = dict(m.properties or {})
            props[TARGET_TOPIC] = m.topic
            letters.append(to_dead_letter(self.cfg.dead_letter_topic, m.body, m.tags, " ".join(m.keys), props,
                                          reason, msg_id=m.msg_id or ""))
        self.producer.send_batch(self.cfg.dead_letter_topic, letters)
        self._count(dead_lettered=len(letters))


def _rows_by_topic(cut: EncodedBatches) -> dict[str, list[int]]:
    """Each target topic's rows of a cut (its batches' and its rejected rows'): every row once."""
    rows: dict[str, list[int]] = {}
    for b in cut.batches:
        mine = rows.get(b.topic)
        if mine is None:
            rows[b.topic] = list(b.index)
        else:
            mine += b.index
    for i, topic, _ in cut.rejected:
        rows.setdefault(topic, []).append(i)
    return rows


def _ids(messages: Sequence[Message], sender: RemotingProducer) -> list[str]:
    """Each message's UNIQ_KEY on its target: derived from its id and due time (fresh without an id)."""
    ids = [delivered_id(m.msg_id, m.deliver_at_ms) if m.msg_id else "" for m in messages]
    if not all(ids):
        spare = iter(sender.new_ids(ids.count("")))
        ids = [i or next(spare) for i in ids]
    return ids


@functools.lru_cache(maxsize=4096)  # a handful of topics take every message: check each once
def _user_topic(topic: str, reserved: frozenset[str]) -> bool:
    """Whether the contract allows delivering to `topic`."""
    try:
        check_target_topic(topic, reserved)
    except ContractViolation:
        return False
    return True
