"""Zero duplicates through the real local RocketMQ: an engine that dies between its sends and their
records leaves copies on the target; the engine that serves its directory next looks them up and
sends only the rest, so a consumer of the target sees each message once. Without the look-up (the
negative control) the same crash delivers copies twice."""
from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from forwarder.config import RocketMQConfig
from forwarder.contract import ORIGINAL_MSG_ID
from forwarder.copy_finder import BrokerCopyFinder
from forwarder.delivery import RocketMQSink
from forwarder.local_rocketmq import LocalRocketMQ
from forwarder.rocketmq import ReceivedMessage, RemotingProducer, RemotingPullConsumer
from tests.polling import wait_for
from timewheel import Engine, EngineConfig, Message

# the first engine's dispatch thread dies on purpose
pytestmark = [pytest.mark.rocketmq, pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")]
N = 300


class DiesAfterSends:
    """The real sink, and a process that dies after `after` send batches were stored, before their
    outcomes are recorded (the dispatch thread ends; nothing more is recorded or sent)."""

    def __init__(self, inner: RocketMQSink, after: int) -> None:
        self.inner, self.after, self.calls = inner, after, 0
        self.max_in_flight, self.linger_ms = 1, inner.linger_ms
        self.dead = threading.Event()

    def send_records(self, records: Any, extra: Any = None, fence: Any = None) -> list[bool]:
        if self.dead.is_set():
            raise SystemExit("dead")
        results = self.inner.send_records(records, extra, fence)
        self.calls += 1
        if self.calls >= self.after:
            self.dead.set()
            raise SystemExit("killed after the write, before the record")
        return results

    def send_batch(self, messages: Any) -> list[bool]:
        return self.inner.send_batch(messages)

    def dead_letter(self, messages: Any, reason: str) -> None:
        self.inner.dead_letter(messages, reason)


def _now() -> int:
    return int(time.time() * 1000)


def _crash_then_restart(rocketmq: LocalRocketMQ, data_dir: Path, dedupe: bool) -> tuple[Counter[str], dict[str, int]]:
    """Copies per original id on the target after a crash mid-delivery and a restart; the counters
    of the look-ups of the engine that restarted."""
    run = uuid.uuid4().hex[:8]
    target = f"TW_DEDUPE_{run}"
    rocketmq.create_topics([target])
    cfg = RocketMQConfig(namesrv=rocketmq.namesrv_addr, producer_group=f"tw_dedupe_{run}", send_threads=1,
                         dedupe_quiet_ms=500)
    received: list[ReceivedMessage] = []
    lock = threading.Lock()

    def on_batch(batch: Sequence[ReceivedMessage]) -> bool:
        with lock:
            received.extend(batch)
        return True
    consumer = RemotingPullConsumer(rocketmq.namesrv_addr, f"tw_dedupe_reader_{run}", target, on_batch)
    consumer.start()
    dead_letters = RemotingProducer(cfg.namesrv, cfg.producer_group)
    engine_cfg = EngineConfig(data_dir, send_batch_size=32)
    try:
        sink = DiesAfterSends(RocketMQSink(cfg, dead_letters), after=3)
        first = Engine(engine_cfg, sink, copy_finder=BrokerCopyFinder(cfg, _now) if dedupe else None).start()
        due = _now() + 1500
        first.schedule([Message(target, f"{run}-{i}".encode(), due + i // 50 * 20) for i in range(N)])
        assert sink.dead.wait(30), "the first engine never sent"
        first.stop()

        def received_count() -> int:
            with lock:
                return len(received)
        # the first engine's batches were stored before it died: wait for them to reach the consumer,
        # which may trail the broker by a pull
        assert wait_for(lambda: received_count() >= 64, 30), \
            f"the first engine stored {received_count()} copies it never recorded, not the 64 its batches hold"
        finder = BrokerCopyFinder(cfg, _now) if dedupe else None
        second = Engine(engine_cfg, RocketMQSink(cfg, dead_letters), copy_finder=finder).start()
        try:
            def copies() -> Counter[str]:
                with lock:
                    return Counter(m.properties[ORIGINAL_MSG_ID] for m in received)
            assert wait_for(lambda: len(copies()) >= N, 60), f"{len(copies())} of {N} delivered"
            time.sleep(2)  # anything sent twice has arrived by now
            counts = second.recovery.snapshot() if second.recovery is not None else {}
        finally:
            second.stop()
            if finder is not None:
                finder.close()
        return copies(), counts
    finally:
        dead_letters.close()
        consumer.stop()


def test_a_crash_between_send_and_record_delivers_each_message_once(rocketmq: LocalRocketMQ,
                                                                    tmp_path: Path) -> None:
    copies, counts = _crash_then_restart(rocketmq, tmp_path / "d", dedupe=True)
    assert len(copies) == N and set(copies.values()) == {1}, Counter(copies.values())
    assert counts["found"] >= 32 and counts["missing"] >= 1 and counts["unknown"] == 0, counts


def test_without_the_look_up_the_same_crash_delivers_copies_twice(rocketmq: LocalRocketMQ, tmp_path: Path) -> None:
    copies, _ = _crash_then_restart(rocketmq, tmp_path / "d", dedupe=False)
    assert len(copies) == N and max(copies.values()) == 2 and sum(v == 2 for v in copies.values()) >= 32
