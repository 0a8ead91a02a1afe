"""Fail-stop on the delivery path: after a failure, what was not sent stays in memory or before the
watermark, so a standby taking over from this holder never skips a message it did not send."""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pytest

from storage import StorageWriteError
from tests.timewheel.conftest import T0, RecordingSink, drive
from timewheel import Engine, EngineConfig, ManualClock, Message


class Tokens:
    """A shaper with a rule in force whose grants the test hands out (`tokens` per topic in all)."""

    def __init__(self, tokens: int) -> None:
        self.tokens = tokens
        self.sent: Counter[str] = Counter()

    def grant(self, backlog: Mapping[str, int], now_ms: int) -> dict[str, int]:
        out = {}
        for topic, n in backlog.items():
            out[topic] = min(n, self.tokens)
            self.tokens -= out[topic]
        return out

    def next_grant_ms(self, now_ms: int) -> int | None:
        return now_ms + 1000

    def release(self, topic: str, n: int) -> None:
        self.tokens += n

    def record(self, topic: str, sent: int, failed: int, held_ms: float, now_ms: int) -> None:
        self.sent[topic] += sent

    def stats(self) -> dict[str, object]:
        return {}

    def passes_through(self) -> bool:
        return False


def _published(e: Engine, stored: int) -> tuple[int, int] | None:
    """What a lease holder would publish now (`coordination.ShardReplica._publish`): the offset below
    which it had stored the delay queue (read first), then the watermark; None when it publishes
    nothing (the mark is frozen by a failure)."""
    mark = e.delivered_up_to_except(64)
    if mark.frozen:
        return None
    return mark.up_to, stored


def test_a_granted_batch_whose_outcome_cannot_be_recorded_goes_back_and_the_watermark_stays_before_it(
        tmp_path: Path, clock: ManualClock) -> None:
    """With a traffic rule in force, a send batch granted from the shaper's held queues (taken in an
    earlier pass) fails and its RETRIED rows cannot be written (a full disk). That batch was once in
    no list: neither queued again nor held, and the dispatcher not marked failed, so the watermark
    passed messages nobody had sent, and a standby taking over would have skipped them."""
    sink = RecordingSink(clock)
    shaper = Tokens(2)
    e = Engine(EngineConfig(tmp_path / "data"), sink, clock, shaper=shaper, seed=1).start(background=False)
    run = e._require_started()
    try:
        ids = e.schedule([Message("T", str(i).encode(), T0 + 1000 + i * 10, msg_id=f"{i:032X}:00000001")
                          for i in range(10)])
        drive(e, clock, T0 + 2000)
        assert len(sink.sent) == 2 and run.dispatcher.held_size() == 8  # two granted, the rest held
        before = e.delivered_up_to()
        assert before == T0 + 1020 - 1  # the first held one bounds it

        real = run.store.record_dispatch

        def full_disk(*a: Any, **kw: Any) -> None:
            raise StorageWriteError("No space left on device")

        run.store.record_dispatch = full_disk  # type: ignore[method-assign]
        sink.fail_next = 4  # the broker refuses the next granted batch: RETRIED rows to write
        shaper.tokens = 4
        clock.set(T0 + 3000)
        with pytest.raises(StorageWriteError):
            e.step()
        ready, backlog, retrying = run.queue.sizes()
        assert ready + backlog + retrying + run.dispatcher.held_size() == 8, (
            f"lost from memory: queued {(ready, backlog, retrying)}, held {run.dispatcher.held_size()}")
        assert e.delivered_up_to() <= before, "the watermark passed messages that were never sent"
        assert e.delivered_up_to_except(64).up_to <= before
        assert run.dispatcher.failed, "the dispatcher takes nothing more once a pass failed"

        # the disk has room again, the engine dispatches again: every message goes out, none lost
        run.store.record_dispatch = real  # type: ignore[method-assign]
        run.dispatcher.failed = False
        shaper.tokens = 100
        drive(e, clock, T0 + 60_000)
        assert sorted(mid for mid, _ in sink.sent) == sorted(ids)
    finally:
        e.stop()


@pytest.mark.parametrize("where", ["pass", "listener"])
def test_records_the_timer_lost_to_a_failure_are_never_covered_by_a_published_watermark(
        tmp_path: Path, clock: ManualClock, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """A message arrives already due (ingest lag). The timer's pass fails after taking it off the
    inbound list (`pass`), or the commit listener fails to put it there (`listener`): it is then in
    no list the watermark reads, and a holder once published a watermark past it, with offsets that
    covered it, before its process exited; the standby taking over skipped it for good."""
    from timewheel.timer import TimerDriver

    sink = RecordingSink(clock)
    e = Engine(EngineConfig(tmp_path / "data"), sink, clock, seed=1).start(background=False)
    run = e._require_started()
    try:
        e.schedule([Message("T", b"a", T0 + 1000, msg_id=f"{1:032X}:00000001")])
        drive(e, clock, T0 + 5000)
        assert len(sink.sent) == 1
        stored = 1  # the delay queue's offset below which everything is stored
        published = [_published(e, stored)]
        assert published == [(T0 + 5000, 1)]

        if where == "pass":
            def failing(self: TimerDriver, inbound: list[np.ndarray], now: int) -> None:
                raise OSError(24, "Too many open files")
            monkeypatch.setattr(TimerDriver, "_take_inbound", failing)
        else:
            def failing_listener(self: TimerDriver, locations: np.ndarray) -> None:
                raise MemoryError("could not keep the new records")
            monkeypatch.setattr(TimerDriver, "_on_commit", failing_listener)
            run.store.commit_listeners[:] = [run.timer._on_commit]
        [late] = e.schedule([Message("T", b"late", T0 + 2000, msg_id=f"{2:032X}:00000001")])  # due already
        stored = 2
        published.append(_published(e, stored))
        clock.set(T0 + 5050)
        with pytest.raises((OSError, RuntimeError)):
            e.step()
        published.append(_published(e, stored))
        clock.set(T0 + 5500)
        published.append(_published(e, stored))
        assert [m for m, _ in sink.sent] == [f"{1:032X}:00000001"]  # the late one was never sent
        # a standby takes it as delivered if a published mark is at or past its due time with an
        # offset past it (stored second: offset 1)
        covering = [p for p in published if p is not None and p[0] >= T0 + 2000 and p[1] > 1]
        assert covering == [], f"published {published}: a standby would skip {late}, never sent"
    finally:
        e.stop()
