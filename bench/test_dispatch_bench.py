"""The dispatcher's fixed cost per send step: one dispatch pass of a few messages through a sink
that answers at once (no broker), so what is measured is the engine's own Python work per send:
take from the queue, read the records, the sink call, the outcome records, lateness.

Run: .venv/bin/python -m pytest bench/test_dispatch_bench.py --benchmark-only
"""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from pytest_benchmark.fixture import BenchmarkFixture

from storage import RecordBytes
from timewheel import Engine, EngineConfig, ManualClock, Message

T0 = 1_800_000_000_000


class _InstantRecordSink:
    """Takes stored records as they are and answers every one delivered."""

    def send_batch(self, messages: Sequence[Message]) -> list[bool]:
        return [True] * len(messages)

    def send_records(self, records: RecordBytes) -> list[bool]:
        return [True] * len(records)


@pytest.mark.parametrize("per_send", [1, 20, 256])
def test_dispatch_pass(benchmark: BenchmarkFixture, tmp_path: Path, per_send: int) -> None:
    """One send step of `per_send` messages due now (the records already on disk and popped)."""
    clock = ManualClock(T0)
    engine = Engine(EngineConfig(data_dir=tmp_path / "data"), _InstantRecordSink(), clock, seed=1)
    engine.start(background=False)
    run = engine._run
    assert run is not None
    counter = iter(range(10**9))

    def setup() -> tuple[tuple, dict]:
        clock.advance(1)
        n = next(counter)
        engine.schedule([Message("T", b"x" * 200, clock.now_ms(), msg_id=f"m{n}-{i}") for i in range(per_send)])
        run.timer.run_pass(clock.now_ms())
        return (), {}

    handled = []
    benchmark.pedantic(lambda: handled.append(run.dispatcher.dispatch_pass()), setup=setup, rounds=300,
                       warmup_rounds=20)
    engine.stop()
    assert set(handled) == {per_send}
