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
        self._receipts: dict[bytes, int] = {}
        self._copies: dict[bytes, set[tuple[int, int, int, int]]] = {}  # stored positions seen per body
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
        with self._lock:
            self._receipts[m.body] = self._receipts.get(m.body, 0) + 1
            # one broker's commit-log offset tells its copies apart; with the queue position, copies on
            # two brokers too
            self._copies.setdefault(m.body, set()).add((m.queue_id, m.queue_offset, m.commit_log_offset,
                                                        m.store_timestamp))
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
            with self._lock:
                if self._acked <= self._receipts.keys():
                    return True
            time.sleep(poll_s)
        return False

    def tally(self) -> Tally:
        """What arrived of what was acknowledged."""
        with self._lock:
            delivered = len(self._acked & self._receipts.keys())
            copies = {b: c for b, c in self._copies.items() if b in self._acked}
            duplicates = sum(len(c) - 1 for c in copies.values())
            redeliveries = sum(self._receipts[b] - len(c) for b, c in copies.items())
            shown = tuple(f"{b.decode(errors='replace')}: " + ", ".join(f"q{q}@{o} stored {t}"
                                                                        for q, o, _, t in sorted(c))
                          for b, c in copies.items() if len(c) > 1)[:5]
            return Tally(len(self._acked), delivered, len(self._acked) - delivered, duplicates, redeliveries, shown)

    def close(self) -> None:
        """Stop sending and shut the producer and the consumer down."""
        self.stop_producing()
        self._producer.shutdown()
        self._consumer.shutdown()
