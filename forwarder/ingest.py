"""Ingest: a clustering consumer on the delay topic that stores each message before acknowledging it.

Each message is checked against the producer contract; a message that breaks it goes to the
dead-letter topic with the reason in a property (and is counted), never dropped silently. The
RocketMQ message id (UNIQ_KEY) is the dedup id, so a redelivered or re-sent message is scheduled
once. Consume threads call the engine concurrently, so the store's group commit merges them.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

from forwarder._rmq_native import NativeProducer, NativePushConsumer, ReceivedMessage
from forwarder.contract import ContractLimits, ContractViolation, to_dead_letter, to_message
from forwarder.errors import ForwarderError
from timewheel.config import RocketMQConfig
from timewheel.errors import InvalidMessageError
from timewheel.message import ScheduleFn

log = logging.getLogger("timewheel.ingest")


class DelayTopicIngest:
    """A Source reading the delay topic; one per engine, all engines in one consumer group."""

    def __init__(self, cfg: RocketMQConfig, limits: ContractLimits, now_ms: Callable[[], int],
                 dead_letters: NativeProducer) -> None:
        self.cfg = cfg
        self.limits = limits
        self.now_ms = now_ms
        self._dlq = dead_letters
        self._consumer: NativePushConsumer | None = None
        self._schedule: ScheduleFn | None = None
        self._accepting = threading.Event()
        self._busy = 0
        self._idle = threading.Condition()
        self.counters = {"ingested": 0, "dead_lettered": 0, "redelivered": 0}

    def start(self, schedule: ScheduleFn) -> None:
        """Subscribe to the delay topic and start consuming."""
        self._schedule = schedule
        self._accepting.set()
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
        if self._consumer is not None:
            self._consumer.shutdown(destroy=False)
            self._consumer = None

    def _on_message(self, msg: ReceivedMessage) -> bool:
        if not self._accepting.is_set():
            return False  # shutting down: RocketMQ redelivers it to whoever consumes next
        with self._idle:
            self._busy += 1
        try:
            return self._handle(msg)
        finally:
            with self._idle:
                self._busy -= 1
                self._idle.notify_all()

    def _handle(self, msg: ReceivedMessage) -> bool:
        assert self._schedule is not None
        try:
            message = to_message(msg, self.now_ms(), self.limits)
            self._schedule([message])
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
