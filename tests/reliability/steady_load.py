"""Steady load for the fault harnesses: a producer sending delay messages at a fixed rate, and a
consumer counting every delivery on the target topic, so a checker can compare what was
acknowledged with what really arrived."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from forwarder._rmq_native import LogLevel, NativeProducer, NativePushConsumer
from forwarder.local_rocketmq import LocalRocketMQ
from forwarder.rocketmq import OutgoingMessage, ReceivedMessage
from tests.stored_copies import StoredCopies


@dataclass(frozen=True)
class Tally:
    """Acknowledged = accepted by the broker for the delay topic; the rest counts those only.

    A duplicate is a second copy stored on the target (another queue position); a redelivery is the
    consumer handing the same stored copy over again (RocketMQ's consumers are at-least-once), which
    says nothing about the engine, so it is counted apart."""

    acknowledged: int
    delivered: int
    lost: int
    duplicates: int
    redeliveries: int = 0
    #: for the first few duplicates: body, then each copy's queue@offset and store time (epoch ms)
    duplicate_copies: tuple[str, ...] = ()


class SteadyLoad:
    """Sends `rate` delay messages a second to `delay_topic` (message i due `due_in_ms(i)` after it
    is sent, bodies "<run>-<i>") and counts what `target` receives; `start`, `stop_producing`,
    `wait_delivered`, `tally`, then `close`."""

    def __init__(self, mq: LocalRocketMQ, run: str, delay_topic: str, target: str, *, rate: int,
                 due_in_ms: Callable[[int], int], name: str) -> None:
        self._run, self._delay_topic, self._target = run, delay_topic, target
        self._rate, self._due_in_ms = rate, due_in_ms
        self._copies: StoredCopies[bytes] = StoredCopies()  # stored positions seen per body
        self._acked: set[bytes] = set()
        self._order: list[bytes] = []  # acknowledged bodies, in the order sent
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._consumer = NativePushConsumer(f"{name}_consumer_{run}", mq.namesrv_addr, self._on_message,
                                            log_level=LogLevel.ERROR)
        self._consumer.subscribe(target)
        self._producer = NativeProducer(f"{name}_producer_{run}", mq.namesrv_addr, log_level=LogLevel.ERROR)
        self._thread = threading.Thread(target=self._produce, name=f"{name}-producer", daemon=True)

    def start(self) -> None:
        """Start the consumer, the producer and the sending."""
        self._consumer.start()
        self._producer.start()
        self._thread.start()

    def _on_message(self, m: ReceivedMessage) -> bool:
        self._copies.add(m.body, m)
        return True

    def _produce(self) -> None:
        i = 0
        start = time.monotonic()
        while not self._stop.is_set():
            body = f"{self._run}-{i}".encode()
            due = time.time_ns() // 1_000_000 + self._due_in_ms(i)
            try:
                # the body is the business key too: a checker can look a message up by it
                self._producer.send(OutgoingMessage(self._delay_topic, body, None, body.decode(),
                                                    {"TW_TARGET_TOPIC": self._target, "TW_DELIVER_AT_MS": str(due)}))
                with self._lock:
                    self._acked.add(body)
                    self._order.append(body)
            except Exception:
                pass  # not acknowledged: its producer would send it again; only acknowledged ones are promised
            i += 1
            time.sleep(max(0.0, start + i / self._rate - time.monotonic()))

    def acknowledged_keys(self, picks: Sequence[float]) -> list[str]:
        """Keys of acknowledged messages at fractions `picks` (0 the first sent, 1 the last) of those so far."""
        with self._lock:
            n = len(self._order)
            return [self._order[min(n - 1, int(f * n))].decode() for f in picks] if n else []

    def stop_producing(self) -> None:
        """Stop sending (returns once the last send is answered)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def wait_delivered(self, timeout: float, poll_s: float = 0.25) -> bool:
        """Wait until every acknowledged message arrived at least once (False: not within `timeout`)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            received = self._copies.keys()
            with self._lock:
                if self._acked <= received:
                    return True
            time.sleep(poll_s)
        return False

    def tally(self) -> Tally:
        """What arrived of what was acknowledged."""
        with self._lock:
            acked = set(self._acked)
        arrived = acked & self._copies.keys()
        return Tally(len(acked), len(arrived), len(acked) - len(arrived), self._copies.duplicates(arrived),
                     self._copies.redeliveries(arrived), self._copies.described(arrived))

    def close(self) -> None:
        """Stop sending and shut the producer and the consumer down."""
        self.stop_producing()
        self._producer.shutdown()
        self._consumer.shutdown()
