"""Ingest: a clustering consumer on the delay topic that stores each message before acknowledging it.

Each message is checked against the producer contract; a message that breaks it goes to the
dead-letter topic with the reason in a property (and is counted), never dropped silently. The
RocketMQ message id (UNIQ_KEY) is the dedup id, so a redelivered or re-sent message is scheduled
once.

Two clients can read the delay topic (`rocketmq.ingest_client`): "pull" (default) pulls batches over
the wire protocol (`RemotingPullConsumer`) and stores each batch with one `schedule()` call; "push"
uses the bundled client's push consumer, one message per callback, gathered across its threads
into shared commits (`IngestBatcher`).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from forwarder._rmq_native import NativeProducer, NativePushConsumer, ReceivedMessage
from forwarder.contract import ContractLimits, ContractViolation, to_dead_letter, to_message
from forwarder.errors import ForwarderError
from forwarder.pull_consumer import RemotingPullConsumer
from forwarder.config import RocketMQConfig
from timewheel.errors import InvalidMessageError
from timewheel.message import Message, ScheduleFn

log = logging.getLogger("timewheel.ingest")


@dataclass(slots=True)
class _Slot:
    message: Message
    done: bool = False
    error: BaseException | None = None


class IngestBatcher:
    """Gathers messages from many threads into one `schedule()` call; each caller returns once its
    own message is stored, or raises what storing it raised.

    The push consumer hands each consume thread one message at a time and acknowledges it when
    the callback returns. Serialised by the GIL, the threads rarely reach the store together, so
    its group commit held ~1.4 messages per commit. Here the thread that commits first waits (at
    most `linger_s`) for the threads already inside a callback (`in_flight()`), so a commit takes
    what all of them carry; a lone thread never waits.
    """

    def __init__(self, schedule: ScheduleFn, in_flight: Callable[[], int], *, max_batch: int = 64,
                 linger_s: float = 0.002) -> None:
        self._schedule = schedule
        self._in_flight = in_flight
        self.max_batch = max_batch
        self.linger_s = linger_s
        lock = threading.Lock()
        self._arrived = threading.Condition(lock)  # the committer waits here for more messages
        self._committed = threading.Condition(lock)  # the others wait here for their commit
        self._queue: list[_Slot] = []
        self._committing = False
        self.commits = 0
        self.messages = 0

    def submit(self, message: Message) -> None:
        """Store `message` (with whatever others submit meanwhile); raises what storing it raised."""
        slot = _Slot(message)
        with self._arrived:
            self._queue.append(slot)
            self._arrived.notify()  # only the committer waits on arrivals: no thundering herd
            while not slot.done:
                if self._committing:
                    self._committed.wait()
                    continue
                self._committing = True
                deadline = time.monotonic() + self.linger_s
                while (len(self._queue) < min(self.max_batch, self._in_flight())
                       and (left := deadline - time.monotonic()) > 0):
                    self._arrived.wait(left)
                batch, self._queue = self._queue[:self.max_batch], self._queue[self.max_batch:]
                self._arrived.release()
                try:
                    self._store(batch)
                finally:
                    self._arrived.acquire()
                    self._committing = False
                    self._committed.notify_all()
        if slot.error is not None:
            raise slot.error

    def _store(self, batch: list[_Slot]) -> None:
        """One schedule() for the batch; a message the engine refuses fails alone, not its batch."""
        errors: list[BaseException | None]
        try:
            errors = list(_schedule_refusing(self._schedule, [s.message for s in batch]))
        except BaseException as e:
            errors = [e] * len(batch)
        else:
            self.commits += 1
            self.messages += errors.count(None)
        for slot, refusal in zip(batch, errors):
            slot.error = refusal
            slot.done = True


def _schedule_refusing(schedule: ScheduleFn, messages: list[Message]) -> list[InvalidMessageError | None]:
    """Store `messages`, leaving out each one the engine refuses; per message, its refusal or None.

    Any other error is raised: then none of the messages is known to be stored.
    """
    refusals: list[InvalidMessageError | None] = [None] * len(messages)
    todo = list(range(len(messages)))
    while todo:
        try:
            schedule([messages[i] for i in todo])
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
                    schedule([messages[i]])
                except InvalidMessageError as one:
                    refusals[i] = one
            return refusals
    return refusals


class DelayTopicIngest:
    """A Source reading the delay topic; one per engine, all engines in one consumer group."""

    def __init__(self, cfg: RocketMQConfig, limits: ContractLimits, now_ms: Callable[[], int],
                 dead_letters: NativeProducer) -> None:
        self.cfg = cfg
        self.limits = limits
        self.now_ms = now_ms
        self._dlq = dead_letters
        self._consumer: NativePushConsumer | None = None
        self._puller: RemotingPullConsumer | None = None
        self._batcher: IngestBatcher | None = None
        self._schedule: ScheduleFn | None = None
        self._accepting = threading.Event()
        self._busy = 0
        self._idle = threading.Condition()
        self.counters = {"ingested": 0, "dead_lettered": 0, "redelivered": 0}

    def start(self, schedule: ScheduleFn) -> None:
        """Subscribe to the delay topic and start consuming."""
        self._schedule = schedule
        self._accepting.set()
        if self.cfg.ingest_client == "pull":
            self._puller = RemotingPullConsumer(self.cfg.namesrv, self.cfg.consumer_group, self.cfg.delay_topic,
                                                self._on_batch, pull_batch=self.cfg.consume_batch,
                                                timeout_ms=self.cfg.send_timeout_ms)
            self._puller.start()
            return
        self._batcher = IngestBatcher(schedule, lambda: self._busy, max_batch=self.cfg.consume_batch)
        c = NativePushConsumer(self.cfg.consumer_group, self.cfg.namesrv, self._on_message,
                               thread_count=self.cfg.consume_threads)
        c.subscribe(self.cfg.delay_topic)
        c.start()
        self._consumer = c

    def stop(self) -> None:
        """Stop taking messages (new ones are handed back for redelivery) and shut the consumer down."""
        self._accepting.clear()
        with self._idle:
            while self._busy:
                self._idle.wait(0.1)
        if self._puller is not None:
            self._puller.stop()
            self._puller = None
        if self._consumer is not None:
            self._consumer.shutdown(destroy=False)
            self._consumer = None

    def _on_batch(self, batch: list[ReceivedMessage]) -> bool:
        """Pull consumer callback: store a batch (dead-lettering what breaks the contract); False
        hands the whole batch back to be pulled again."""
        return self._while_accepting(lambda: self._store_batch(batch))

    def _while_accepting(self, work: Callable[[], bool]) -> bool:
        """Run a callback's work unless stopping (False: RocketMQ hands it to whoever consumes next);
        stop() waits for the work in progress."""
        if not self._accepting.is_set():
            return False
        with self._idle:
            self._busy += 1
        try:
            return work()
        finally:
            with self._idle:
                self._busy -= 1
                self._idle.notify_all()

    def _store_batch(self, batch: list[ReceivedMessage]) -> bool:
        assert self._schedule is not None
        now = self.now_ms()
        todo: list[tuple[Message, ReceivedMessage]] = []
        for msg in batch:
            try:
                todo.append((to_message(msg, now, self.limits), msg))
            except ContractViolation as e:
                if not self._dead_letter(msg, e.reason):
                    return False
        try:
            refusals = _schedule_refusing(self._schedule, [m for m, _ in todo])
        except Exception:
            log.exception("storing a batch of %d delay messages failed; it will be pulled again", len(batch))
            self.counters["redelivered"] += len(batch)
            return False
        self.counters["ingested"] += refusals.count(None)
        # A dead letter that cannot be sent hands the batch back; what was stored is deduplicated then.
        return all(self._dead_letter(msg, refusal.reason)
                   for (_, msg), refusal in zip(todo, refusals) if refusal is not None)

    def _on_message(self, msg: ReceivedMessage) -> bool:
        return self._while_accepting(lambda: self._handle(msg))

    def _handle(self, msg: ReceivedMessage) -> bool:
        assert self._batcher is not None
        try:
            message = to_message(msg, self.now_ms(), self.limits)
            self._batcher.submit(message)
        except (ContractViolation, InvalidMessageError) as e:
            reason = getattr(e, "reason", str(e))
            return self._dead_letter(msg, reason)
        except Exception:
            log.exception("storing delay message %s failed; it will be redelivered", msg.msg_id)
            self.counters["redelivered"] += 1
            return False
        self.counters["ingested"] += 1
        return True

    def _dead_letter(self, msg: ReceivedMessage, reason: str) -> bool:
        try:
            dl = to_dead_letter(self.cfg.dead_letter_topic, msg.body, msg.tags, msg.keys, msg.properties, reason)
            dl.properties["TW_ORIGINAL_MSG_ID"] = msg.msg_id  # type: ignore[index]
            self._dlq.send(dl)
        except (ForwarderError, ValueError):
            log.exception("dead-lettering %s failed; it will be redelivered", msg.msg_id)
            return False
        log.warning("dead-lettered delay message %s: %s", msg.msg_id, reason)
        self.counters["dead_lettered"] += 1
        return True
