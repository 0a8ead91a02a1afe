"""What holding tombstones costs ingest, measured A/B in one process so that a busy machine's drift
cancels out: two engines side by side, one with no tombstone and one holding N (none matching, as
in steady state), each storing the same kind of batches (32 messages, one pull) in alternating
rounds. A third arm runs the engine holding tombstones with them hidden from its screen, which
tells the screen's cost (held vs hidden) from that of the engine's larger heap and meta store
(hidden vs none). Prints the median time per message of each, and the screen's own share.

Run: .venv/bin/python -m bench.cancel_ingest_cost [--tombstones 1000000] [--rounds 9]
Results: bench/results/cancel_ingest_cost.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from bench.test_cancel_bench import BATCH, NOW, _batches, _hold_tombstones, _NoSink
from timewheel import Engine, EngineConfig, ManualClock, Message

PER_ROUND = 20_000 // BATCH


def _round(engine: Engine, source: Iterator[list[Message]]) -> float:
    batches = [next(source) for _ in range(PER_ROUND)]
    t0 = time.perf_counter()
    for b in batches:
        engine.schedule(b)
    return (time.perf_counter() - t0) / (PER_ROUND * BATCH)


def _screen_share(engine: Engine, source: Iterator[list[Message]], rounds: int) -> float:
    """Seconds per message of the screen alone on the engine holding tombstones."""
    run = engine._run
    assert run is not None
    batches = [next(source) for _ in range(PER_ROUND)]
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for b in batches:
            run.tombstones.screen(b, NOW)
        samples.append((time.perf_counter() - t0) / (PER_ROUND * BATCH))
    return statistics.median(samples)


def main() -> None:
    """Measure and print (and write the results file)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tombstones", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("results") / "cancel_ingest_cost.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        plain = Engine(EngineConfig(Path(d) / "plain"), _NoSink(), ManualClock(NOW)).start(background=False)
        held = Engine(EngineConfig(Path(d) / "held", max_tombstones=2 * args.tombstones), _NoSink(),
                      ManualClock(NOW)).start(background=False)
        t0 = time.perf_counter()
        _hold_tombstones(held, args.tombstones)
        setup_s = time.perf_counter() - t0
        a, b = _batches("plain"), _batches("held")
        _round(plain, a), _round(held, b)  # warm both
        without: list[float] = []
        with_: list[float] = []
        hidden: list[float] = []
        tombstones = held._run.tombstones if held._run is not None else None
        assert tombstones is not None
        shown = (tombstones._ids, tombstones._keys)
        for i in range(args.rounds):
            arms = [(plain, a, without, shown), (held, b, with_, shown), (held, b, hidden, ({}, {}))]
            for engine, src, out, tables in arms[i % 3:] + arms[:i % 3]:
                tombstones._ids, tombstones._keys = tables
                out.append(_round(engine, src))
            tombstones._ids, tombstones._keys = shown
        screen = _screen_share(held, _batches("screen"), args.rounds)
        plain.stop()
        held.stop()
    ratios = [w / o for w, o in zip(with_, without)]
    screen_ratios = [w / h for w, h in zip(with_, hidden)]
    result = {
        "tombstones": args.tombstones, "rounds": args.rounds, "batch": BATCH, "messages_per_round": PER_ROUND * BATCH,
        "schedule_us_per_msg_without": round(statistics.median(without) * 1e6, 2),
        "schedule_us_per_msg_with": round(statistics.median(with_) * 1e6, 2),
        "schedule_us_per_msg_with_hidden": round(statistics.median(hidden) * 1e6, 2),
        "median_round_ratio_with_vs_without": round(statistics.median(ratios), 3),
        "median_round_ratio_with_vs_hidden": round(statistics.median(screen_ratios), 3),
        "screen_us_per_msg": round(screen * 1e6, 3),
        "apply_cancels_us_per_cancel": round(setup_s / args.tombstones * 1e6, 1),
        "command": "python -m bench.cancel_ingest_cost --tombstones %d --rounds %d" % (args.tombstones, args.rounds),
    }
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
