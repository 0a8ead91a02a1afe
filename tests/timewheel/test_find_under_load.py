"""`MessageFinder` while the engine writes: look-ups racing ingest, dispatch, checkpoints and segment
loads never fail and never call a whole record unreadable (an in-memory sink stands in for the broker)."""
from __future__ import annotations

import random
import threading
import time
import traceback
from pathlib import Path
from typing import Sequence

import numpy as np

from storage import ANSWER_DTYPE, SegmentLayout, check, summarize
from timewheel import Engine, EngineConfig, Message, SystemClock
from timewheel.find import MessageFinder
from timewheel.message import SendResults
from tests.polling import wait_for


class CountingSink:
    """Accepts every message and answers a queue offset for it."""

    def __init__(self) -> None:
        self.sent: set[str] = set()
        self.lock = threading.Lock()

    def send_batch(self, messages: Sequence[Message]) -> SendResults:
        answers = np.zeros(len(messages), ANSWER_DTYPE)
        answers["queue_offset"] = np.arange(len(messages))
        answers["store_ip"] = [127, 0, 0, 1]
        with self.lock:
            self.sent.update(m.msg_id or "" for m in messages)
        return SendResults([True] * len(messages), answers, [None] * len(messages))


def test_look_ups_racing_the_engines_writes_never_fail_and_find_every_acknowledged_message(tmp_path: Path) -> None:
    clock = SystemClock()
    cfg = EngineConfig(data_dir=tmp_path / "data", checkpoint_seconds=0.2)
    sink = CountingSink()
    engine = Engine(cfg, sink, clock, seed=7).start()
    acked: list[str] = []
    errors: list[BaseException] = []
    seen: dict[str, int] = {}
    stop, stop_producing = threading.Event(), threading.Event()

    def produce() -> None:
        n = 0
        while not stop_producing.is_set() and not stop.is_set():
            now = clock.now_ms()
            batch = [Message("ORDERS", b"x" * (i % 300), now + (i * 37) % 400, keys=(f"k{n + i}",),
                             msg_id=f"{n + i:032X}:0000abcd") for i in range(50)]
            engine.schedule(batch)
            acked.extend(m.msg_id or "" for m in batch)
            n += len(batch)
            time.sleep(0.005)

    def look(beside: bool) -> None:
        rng = random.Random(beside)
        try:
            while not stop.is_set():
                if len(acked) < 10:
                    continue
                # recent ones (pending) while the producer runs, any of them (delivered) after it
                recent = 400 if not stop_producing.is_set() and rng.random() < 0.5 else len(acked)
                wanted = acked[-1 - rng.randrange(min(len(acked), recent))]
                uniq = wanted.partition(":")[0]
                assert engine.store is not None
                finder = (MessageFinder.beside_engine(tmp_path / "data") if beside
                          else MessageFinder(engine.store.layout, engine.store.meta))
                with finder:
                    for found in (finder.by_id(uniq, clock.now_ms()), finder.by_key(f"k{int(uniq, 16)}", clock.now_ms())):
                        states = [t.state for t in found.trails]
                        # an acknowledged message is stored: the engine's own finder sees it at once
                        assert beside or states, (wanted, found.to_dict())
                        assert set(states) <= {"pending", "delivered"}, found.to_dict()
                        for s in states:
                            seen[s] = seen.get(s, 0) + 1
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            errors.append(e)
            stop.set()

    inspections: list[int] = []

    def inspect() -> None:  # what `timewheel inspect --verify` reads, beside the engine
        try:
            while not stop.is_set():
                assert engine.store is not None
                layout = SegmentLayout.open_existing(tmp_path / "data")
                report = summarize(layout)
                assert not report["totals"]["corrupt"], report  # type: ignore[index]
                findings = check(layout).findings
                assert not findings, findings
                inspections.append(1)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            errors.append(e)
            stop.set()

    threads = [threading.Thread(target=produce), threading.Thread(target=look, args=(False,)),
               threading.Thread(target=look, args=(True,)), threading.Thread(target=inspect)]
    try:
        for t in threads:
            t.start()
        time.sleep(6)
        stop_producing.set()  # the look-ups go on while what was stored comes due and is delivered
        time.sleep(3)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    try:
        assert not errors, "".join(traceback.format_exception(errors[0]))
        assert wait_for(lambda: len(sink.sent) == len(set(acked)), 30), (len(sink.sent), len(set(acked)))
        assert seen.get("pending", 0) > 0 and seen.get("delivered", 0) > 0, seen
        assert len(inspections) >= 3, inspections
    finally:
        engine.stop()
