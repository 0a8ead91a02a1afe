"""What cancels cost ingest: `Engine.schedule` of delay-topic-sized batches with 0 or 1M tombstones
held (none matching, as in steady state), and the tombstone screen on its own.

Run: .venv/bin/python -m pytest bench/test_cancel_bench.py --benchmark-only
The 0-tombstone case also runs against a build without cancels (it calls nothing new), so the
same command with that build on PYTHONPATH gives the "before" figure.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from pytest_benchmark.fixture import BenchmarkFixture

from timewheel import Engine, EngineConfig, ManualClock, Message

from bench.conftest import HOUR, NOW

BODY = b"x" * 200
BATCH = 32  # rocketmq.consume_batch: one pull, one schedule() call
PER_ROUND = 20_000


class _NoSink:
    def send_batch(self, messages: Sequence[Message]) -> list[bool]:  # nothing comes due during the benchmark
        return [True] * len(messages)


def _batches(prefix: str) -> Iterator[list[Message]]:
    for b in itertools.count():
        yield [Message("ORDERS", BODY, NOW + HOUR + (b * BATCH + i) % HOUR, keys=(f"order-{prefix}-{b}-{i}",),
                       msg_id=f"{b:016X}{i:016X}:0badc0de") for i in range(BATCH)]


def _hold_tombstones(engine: Engine, n: int) -> None:
    from timewheel.cancels import CancelRequest

    for start in range(0, n, 10_000):
        engine.apply_cancels([CancelRequest(f"C{j:031X}", None, NOW) if j % 2 else
                              CancelRequest(None, f"cancelled-order-{j}", NOW) for j in range(start, start + 10_000)])


@pytest.mark.parametrize("tombstones", [0, 1_000_000])
def test_schedule_batches_of_32(benchmark: BenchmarkFixture, tmp_path: Path, tombstones: int) -> None:
    engine = Engine(EngineConfig(tmp_path / "data"), _NoSink(), ManualClock(NOW)).start(background=False)
    if tombstones:
        _hold_tombstones(engine, tombstones)
    source = _batches(str(tombstones))

    def setup() -> tuple[tuple[list[list[Message]]], dict[str, object]]:
        return ([next(source) for _ in range(PER_ROUND // BATCH)],), {}

    def run(batches: list[list[Message]]) -> None:
        for b in batches:
            engine.schedule(b)

    benchmark.pedantic(run, setup=setup, rounds=5, iterations=1)
    assert benchmark.stats is not None
    benchmark.extra_info["messages_per_s"] = round(PER_ROUND // BATCH * BATCH / benchmark.stats.stats.median)
    engine.stop()


@pytest.mark.parametrize("tombstones", [1_000, 1_000_000])
def test_screen_a_batch_of_32(benchmark: BenchmarkFixture, tmp_path: Path, tombstones: int) -> None:
    from storage import TombstoneLog
    from timewheel.cancels import CancelRequest, Tombstones

    t = Tombstones(TombstoneLog(tmp_path), retention_ms=HOUR, max_entries=2 * tombstones)
    t.load(NOW)
    held = t.add([CancelRequest(f"C{j:031X}", None, NOW) if j % 2 else CancelRequest(None, f"cancelled-order-{j}", NOW)
                  for j in range(tombstones)], NOW)
    t.save(NOW, held)
    batch = next(_batches("screen"))
    assert benchmark(t.screen, batch, NOW) == []
    assert benchmark.stats is not None
    benchmark.extra_info["us_per_message"] = round(benchmark.stats.stats.median / BATCH * 1e6, 3)
    t.close()
