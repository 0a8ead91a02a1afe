"""Outcomes of failed sends: what each message's dispatch-log row says when the dead-letter path fails too."""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Sequence

import numpy as np

from storage import DEAD_LETTERED, RETRIED, ScheduleStore
from tests.timewheel.conftest import T0
from timewheel import EngineConfig, ManualClock, Message
from timewheel._held import Batch
from timewheel._outcomes import DispatchCounters, Outcomes
from timewheel.dispatch_queue import DispatchQueue


class _DownDeadLetters:
    """A dead-letter path that is down."""

    def dead_letter(self, messages: Sequence[Message], reason: str) -> None:
        raise ConnectionError("dead-letter topic unreachable")


def test_a_failed_dead_letter_is_noted_only_on_the_messages_that_were_due_one(tmp_path: Path) -> None:
    # the others failed an ordinary attempt: their rows must not say a dead letter was tried
    store = ScheduleStore(tmp_path)
    clock = ManualClock(T0)
    try:
        outcomes = Outcomes(EngineConfig(tmp_path, max_attempts=3), store, DispatchQueue(clock, batch_size=10,
                            catch_up_chunk=10), DispatchCounters(), threading.Lock(), _DownDeadLetters(), seed=1)
        seg = store.layout.segment_start(T0)
        batch = Batch([Message("T", b"last", T0), Message("T", b"first", T0)], np.array([T0, T0], np.int64),
                      np.array([1, 2], np.uint64), np.array([2, 0], np.int16), np.array([seg, seg], np.int64),
                      np.array([0, 0], np.int64), np.array([0, 100], np.int64))
        outcomes.fail(batch, T0, ["BrokerBusyError: busy", "BrokerBusyError: busy"])
        log = store.dispatch_log(seg)
        rows = {int(e["offset"]): (int(e["outcome"]), log.notes[int(log.note[i])])
                for i, e in enumerate(log.entries)}
    finally:
        store.close()
    assert rows[0][0] == RETRIED and "dead letter failed too" in rows[0][1], rows  # it stays, retrying
    assert rows[100] == (RETRIED, "BrokerBusyError: busy"), rows
    assert DEAD_LETTERED not in {o for o, _ in rows.values()}
