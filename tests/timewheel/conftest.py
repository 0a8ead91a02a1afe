"""Fixtures for engine tests: a manual clock, a recording sink and an engine factory."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import pytest

from timewheel import Engine, EngineConfig, ManualClock, Message
from timewheel.message import Sink

T0 = 1_800_000_000_000  # 2027-01-15T08:00:00Z, on an hour boundary

MakeEngine = Callable[..., Engine]  # the make_engine fixture: EngineConfig's keywords, a started engine


class RecordingSink:
    """Records (msg_id, clock time) of every send; can be told to fail."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.sent: list[tuple[str, int]] = []
        self.messages: list[Message] = []
        self.fail_next = 0
        self.busy = False

    def send_batch(self, messages: Sequence[Message]) -> list[bool]:
        if self.busy:
            raise ConnectionError("broker busy")
        out = []
        for m in messages:
            if self.fail_next:
                self.fail_next -= 1
                out.append(False)
                continue
            assert m.msg_id is not None
            self.sent.append((m.msg_id, self.clock.now_ms()))
            self.messages.append(m)
            out.append(True)
        return out


def drive(engine: Engine, clock: ManualClock, until_ms: int, max_steps: int = 1_000_000) -> None:
    """Step the engine through every wake-up up to `until_ms`, then to `until_ms` itself."""
    for _ in range(max_steps):
        t = engine.next_wakeup_ms()
        if t is None or t > until_ms:
            break
        if t > clock.now_ms():
            clock.set(t)
        if engine.step() == 0 and engine.next_wakeup_ms() == clock.now_ms():
            # nothing moved yet something claims to be due now: a bug, not a wait
            raise AssertionError(f"engine spins at {clock.now_ms()}: {engine.stats()}")
    if until_ms > clock.now_ms():
        clock.set(until_ms)
    engine.step()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(T0)


@pytest.fixture
def sink(clock: ManualClock) -> RecordingSink:
    return RecordingSink(clock)


@pytest.fixture
def make_engine(tmp_path: Path, clock: ManualClock, sink: RecordingSink) -> Iterator[MakeEngine]:
    engines: list[Engine] = []
    recording = sink

    def make(*, sink: Sink | None = None, data_dir: Path | None = None, **kw: Any) -> Engine:
        # `sink` is taken out before the rest goes to EngineConfig, which has no such field
        cfg = EngineConfig(data_dir=data_dir if data_dir is not None else tmp_path / "data", **kw)
        e = Engine(cfg, sink if sink is not None else recording, clock, seed=1).start(background=False)
        engines.append(e)
        return e

    yield make
    for e in engines:
        e.stop()
