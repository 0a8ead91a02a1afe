"""Ingest: a clustering consumer on the delay topic that stores each message before acknowledging it.

Each message is checked against the producer contract; a message that breaks it goes to the
dead-letter topic with the reason in a property (and is counted), never dropped silently. The
RocketMQ message id (UNIQ_KEY) is the dedup id, so a redelivered or re-sent message is scheduled
once.

The delay topic is read by the wire client's pull consumer (`forwarder.rocketmq.RemotingPullConsumer`),
which hands over batches; each batch is stored in one store commit, and its offset is committed
only after that. Started with the engine as `encoded`, the consumer reads each pull answer in one
pass (`forwarder._ingest_pass`): the common messages arrive as record bytes, and only the others
are looked at here one by one, then all go to `Engine.schedule_encoded` in arrival order; without
it, every message is looked at here and the batch goes to `schedule()`. Dead letters go through a
`RemotingProducer`.

A store that fails is retried by pulling the batch again, unless no retry can succeed (`FOR_GOOD`:
its meta store is corrupt or RocksDB stopped its writes, it is closed): then the callback raises
`BatchesRefusedError`, which stops the pull thread (fail-stop: the service goes not ready and `serve`
exits 3), the batch unacknowledged.
A failure that passes is logged as a run (`timewheel.failure_log`): its traceback once, then once a
minute with the count, not at every pull of every queue until `consume_refused_max_s`.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from forwarder.config import RocketMQConfig
from forwarder.contract import (ContractLimits, ContractViolation, raw_dead_letter, to_dead_letter,
                                to_message)
from forwarder.control import split_control, to_cancel
from forwarder._ingest_merge import merge_answers
from forwarder._ingest_pass import OnePass, PulledAnswer
from forwarder.errors import ForwarderError
from forwarder.rocketmq import BatchesRefusedError, ReceivedMessage, RemotingProducer, RemotingPullConsumer
from forwarder.rocketmq.consumer import BodyReader
from timewheel.errors import InvalidMessageError
from timewheel.failure_log import RepeatedFailureLog
from storage import MetaStoreCorruptError, MetaStoreStoppedError, Origin, StoreClosedError
from timewheel.message import CancelFn, EncodedScheduler, Message, ScheduleFn

log = logging.getLogger("timewheel.ingest")

#: store errors that every later write meets too, so a batch they refused is never pulled again here
#: (a full disk, `StorageWriteError`, may clear: it is retried, unless RocksDB's writes stopped on it)
FOR_GOOD: tuple[type[Exception], ...] = (MetaStoreCorruptError, MetaStoreStoppedError, StoreClosedError)


def _schedule_refusing(schedule: ScheduleFn, messages: list[Message],
                       origins: list[Origin]) -> list[InvalidMessageError | None]:
    """Store `messages` (from `origins`), leaving out each one the engine refuses; per message, its
    refusal or None.

    Any other error is raised: then none of the messages is known to be stored.
    """
    return _refusing(lambda rows: schedule([messages[i] for i in rows], [origins[i] for i in rows]), len(messages))


def _refusing(store: Callable[[list[int]], object], n: int) -> list[InvalidMessageError | None]:
    """Store rows 0..n-1 with `store(rows)`, leaving out each one the engine refuses (an
    InvalidMessageError naming its index among `rows`); per row, its refusal or None."""
    refusals: list[InvalidMessageError | None] = [None] * n
    todo = list(range(n))
    while todo:
        try:
            store(todo)
            return refusals
        except InvalidMessageError as e:
            if e.index is not None:
                refusals[todo.pop(e.index)] = InvalidMessageError(e.reason)
                continue
            if len(todo) == 1:
                refusals[todo[0]] = e
                return refusals
            for i in todo:  # the engine did not say which: one at a time
                try:
                    store([i])
                except InvalidMessageError as one:
                    refusals[i] = one
            return refusals
    return refusals


class DelayTopicIngest:
    """A Source reading the delay topic; one per engine, all engines in one consumer group."""

    def __init__(self, cfg: RocketMQConfig, limits: ContractLimits, now_ms: Callable[[], int],
                 dead_letters: RemotingProducer, *, queue_ids: Callable[[int], bool] | None = None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        """Configure (nothing connects until start()); dead letters go through `dead_letters`;
        `queue_ids`: read only the delay topic's queues whose id it accepts (a replica's shard);
        `monotonic`: the clock a run of store failures is logged by."""
        self.queue_ids = queue_ids
        self.cfg = cfg
        self.limits = limits
        self.now_ms = now_ms
        self._dlq = dead_letters
        self._puller: RemotingPullConsumer | None = None
        self._schedule: ScheduleFn | None = None
        self._cancel: CancelFn | None = None
        self._encoded: EncodedScheduler | None = None
        self._accepting = threading.Event()
        self._busy = 0
        self._idle = threading.Condition()
        #: why the store can take nothing more (a `FOR_GOOD` error met), once it was met
        self._failed: str | None = None
        #: a store (or cancel) failure that passes: every pull thread's batch meets it, each retry
        self._store_failures = RepeatedFailureLog(log, monotonic)
        #: a replica's own start offsets (`RemotingPullConsumer.start_offsets`); None: the group's
        self.start_offsets: dict[str, int] | None = None
        #: "one_pass": messages stored as the one pass encoded them (the rest of "ingested" took the general path)
        self.counters = {"ingested": 0, "dead_lettered": 0, "dead_lettered_raw": 0, "redelivered": 0,
                         "cancels_received": 0, "one_pass": 0}

    def start(self, schedule: ScheduleFn, cancel: CancelFn | None = None,
              encoded: EncodedScheduler | None = None) -> None:
        """Subscribe to the delay topic and start consuming; cancels (control messages) go to
        `cancel` (without one they are dead-lettered). With `encoded` (the engine), each pull answer
        is read in one pass (`forwarder._ingest_pass`): its common messages go to the store as
        record bytes, the rest the way `schedule` takes them, in one commit."""
        self._schedule = schedule
        self._cancel = cancel
        self._encoded = encoded
        self._accepting.set()
        reader = BodyReader(OnePass(self.limits, self.now_ms).read, PulledAnswer.of_messages) if encoded else None
        self._puller = RemotingPullConsumer(self.cfg.namesrv, self.cfg.consumer_group, self.cfg.delay_topic,
                                            self._on_answers if encoded else self._on_batch,
                                            reader=reader, pull_batch=self.cfg.consume_batch,
                                            pull_linger_ms=self.cfg.consume_linger_ms,
                                            max_refused_s=self.cfg.consume_refused_max_s,
                                            timeout_ms=self.cfg.send_timeout_ms,
                                            max_body_bytes=self.limits.max_body_bytes,
                                            security=self.cfg.security(),
                                            queue_filter=self._in_shard if self.queue_ids is not None else None)
        self._puller.start_offsets = self.start_offsets
        self._puller.start()

    def catch_up(self) -> tuple[int | None, list[str]]:
        """(when every queue read here last held nothing more to read, None while not yet or while it
        reads none; the offset moves the broker made since start: gaps)."""
        puller = self._puller
        if puller is None:
            return None, []
        caught_up = puller.caught_up_ms()
        return (caught_up or None), list(puller.offsets_moved)

    def counter_values(self) -> dict[str, int]:
        """The ingest's counters and, once started, its pull consumer's (`pulled`, `refused`, `bad_answers`,
        `offset_resets`, `pull_gaps`: answers that skipped offsets, each pulled again before being passed over)."""
        puller = self._puller
        return {**self.counters, **(puller.counters if puller is not None else {})}

    def stored_offsets(self) -> dict[str, int]:
        """Per queue read here (`broker:queue id`), the offset below which everything was stored (or
        dead-lettered, or applied as a cancel): what a replica holding its shard's lease publishes."""
        puller = self._puller
        return puller.stored_offsets() if puller is not None else {}

    def dead_threads(self) -> list[str]:
        """The consumer's threads that an error ended while it runs (`RemotingPullConsumer.dead_threads`)."""
        puller = self._puller
        return puller.dead_threads() if puller is not None else []

    def thread_failures(self) -> dict[str, str]:
        """Of the threads `dead_threads` names, the error that ended each."""
        puller = self._puller
        return puller.thread_failures() if puller is not None else {}

    def _in_shard(self, queue: tuple[str, int]) -> bool:
        """Whether a (broker, queue id) of the delay topic is read by this engine."""
        return self.queue_ids is None or self.queue_ids(queue[1])

    def stop(self) -> None:
        """Stop taking messages (new ones are handed back for redelivery) and shut the consumer down."""
        self._accepting.clear()
        with self._idle:
            while self._busy:
                self._idle.wait(0.1)
        if self._puller is not None:
            self._puller.stop()
            self._puller = None

    def _on_batch(self, batch: list[ReceivedMessage]) -> bool:
        """Pull consumer callback: store a batch (dead-lettering what breaks the contract); False
        hands the whole batch back to be pulled again."""
        return self._while_accepting(lambda: self._store_batch(batch))

    def _while_accepting(self, work: Callable[[], bool]) -> bool:
        """Run a callback's work unless stopping (False: RocketMQ hands it to whoever consumes next);
        stop() waits for the work in progress."""
        if not self._accepting.is_set():
            return False
        if self._failed is not None:  # another pull thread's batch: the store is not tried again
            raise BatchesRefusedError(self._failed)
        with self._idle:
            self._busy += 1
        try:
            return work()
        finally:
            with self._idle:
                self._busy -= 1
                self._idle.notify_all()

    def _admit(self, batch: list[ReceivedMessage], now: int) -> list[tuple[Message, ReceivedMessage]] | None:
        """A batch's messages as the contract reads them: cancels applied, what cannot be read or
        breaks the contract dead-lettered; the messages to store, each with what it was read from
        (None: a dead letter or a cancel failed, the batch is handed back)."""
        batch, control = split_control(batch)
        if control and not self._apply_cancels(control, now):
            return None
        todo: list[tuple[Message, ReceivedMessage]] = []
        for msg in batch:
            if msg.undecodable is not None:
                if not self._dead_letter_raw(msg):
                    return None
                continue
            try:
                todo.append((to_message(msg, now, self.limits), msg))
            except ContractViolation as e:
                if not self._dead_letter(msg, e.reason):
                    return None
        return todo

    def _store_batch(self, batch: list[ReceivedMessage]) -> bool:
        assert self._schedule is not None
        todo = self._admit(batch, self.now_ms())
        if todo is None:
            return False
        try:
            refusals = _schedule_refusing(self._schedule, [m for m, _ in todo], [r.origin for _, r in todo])
        except FOR_GOOD as e:
            raise self._failed_for_good(f"storing a batch of {len(batch)} delay messages", e) from e
        except Exception as e:
            self._store_failures.failed(e, "storing a batch of %d delay messages failed; it will be pulled again",
                                        len(batch))
            self.counters["redelivered"] += len(batch)
            return False
        self._stored()
        self.counters["ingested"] += refusals.count(None)
        # A dead letter that cannot be sent hands the batch back; what was stored is deduplicated then.
        return all(self._dead_letter(msg, refusal.reason)
                   for (_, msg), refusal in zip(todo, refusals) if refusal is not None)

    def _on_answers(self, answers: list[PulledAnswer]) -> bool:
        """Pull consumer callback with a one-pass reader: `_on_batch` for pull answers read so."""
        return self._while_accepting(lambda: self._store_answers(answers))

    def _store_answers(self, answers: list[PulledAnswer]) -> bool:
        encoded = self._encoded
        assert encoded is not None
        todo = self._admit([m for a in answers for m in a.general], self.now_ms())
        if todo is None:
            return False
        try:
            rows, refusals = encoded.encode_messages([m for m, _ in todo], [r.origin for _, r in todo])
            batch, sources = merge_answers(answers, [r for _, r in todo], rows, refusals)
            stored = _refusing(lambda kept: encoded.schedule_encoded(batch if len(kept) == len(batch)
                                                                     else batch.take(kept)), len(batch))
        except FOR_GOOD as broken:
            n = sum(len(a) for a in answers)
            raise self._failed_for_good(f"storing a batch of {n} delay messages", broken) from broken
        except Exception as failure:
            n = sum(len(a) for a in answers)
            self._store_failures.failed(failure, "storing a batch of %d delay messages failed; it will be pulled "
                                        "again", n)
            self.counters["redelivered"] += n
            return False
        self._stored()
        self.counters["ingested"] += stored.count(None)
        refused = [(r, e.reason) for (_, r), e in zip(todo, refusals) if e is not None]
        one_pass = sum(len(a.rows) for a in answers)
        if stored.count(None) < len(stored):
            for i, e in enumerate(stored):
                if e is not None:
                    one_pass -= not sources.is_general(i)
                    refused.append((sources.received(i), e.reason))
        self.counters["one_pass"] += one_pass
        # A dead letter that cannot be sent hands the batch back; what was stored is deduplicated then.
        return all(self._dead_letter(msg, reason) for msg, reason in refused)

    def _apply_cancels(self, control: list[ReceivedMessage], now: int) -> bool:
        """Hand a batch's cancels to the engine (kept durably before the batch is acknowledged);
        a malformed one is dead-lettered. False hands the batch back."""
        requests = []
        for msg in control:
            try:
                if self._cancel is None:
                    raise ContractViolation("this engine was started without a cancel handler")
                requests.append(to_cancel(msg, now))
            except ContractViolation as e:
                if not self._dead_letter(msg, e.reason):
                    return False
        if requests and self._cancel is not None:
            try:
                self._cancel(requests)
            except FOR_GOOD as e:
                raise self._failed_for_good(f"applying {len(requests)} cancels", e) from e
            except Exception as e:
                self._store_failures.failed(e, "applying %d cancels failed; the batch will be pulled again",
                                            len(requests))
                return False
            self._stored()
            self.counters["cancels_received"] += len(requests)
        return True

    def _stored(self) -> None:
        """A store (or cancel) went through: a run of failures before it ends, told once."""
        run = self._store_failures.end()
        if run is not None:
            log.info("the store takes batches again after %d failed over %.1f s", *run)

    def _failed_for_good(self, what: str, error: Exception) -> BatchesRefusedError:
        """The error that stops the pull thread which met `error`; every later batch is refused with
        it, the store not tried. Its own words come early: /readyz shows a reason's head only."""
        self._failed = f"{what} failed for good, pulling stopped, none acknowledged: {type(error).__name__}: {error}"
        return BatchesRefusedError(self._failed)

    def _dead_letter(self, msg: ReceivedMessage, reason: str) -> bool:
        try:
            dl = to_dead_letter(self.cfg.dead_letter_topic, msg.body, msg.tags, msg.keys, msg.properties, reason,
                                msg_id=msg.msg_id, queue_id=msg.queue_id, queue_offset=msg.queue_offset)
            self._dlq.send_batch(dl.topic, [dl])
        except (ForwarderError, ValueError):
            log.exception("dead-lettering %s failed; it will be redelivered", msg.msg_id)
            return False
        log.warning("dead-lettered delay message %s: %s", msg.msg_id, reason)
        self.counters["dead_lettered"] += 1
        return True

    def _dead_letter_raw(self, msg: ReceivedMessage) -> bool:
        """Park a message that cannot be read: its stored bytes, why, and where it was."""
        try:
            dl = raw_dead_letter(self.cfg.dead_letter_topic, msg.body, msg.undecodable or "unreadable",
                                 msg.queue_id, msg.queue_offset, msg_id=msg.msg_id, keys=msg.keys or None,
                                 properties=msg.properties)
            self._dlq.send_batch(dl.topic, [dl])
        except (ForwarderError, ValueError):
            log.exception("dead-lettering the unreadable message at queue %d offset %d failed; it will be pulled "
                          "again", msg.queue_id, msg.queue_offset)
            return False
        log.warning("dead-lettered the unreadable message at queue %d offset %d raw: %s", msg.queue_id,
                    msg.queue_offset, msg.undecodable)
        self.counters["dead_lettered_raw"] += 1
        return True
