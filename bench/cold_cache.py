"""What a send step of one message costs the engine with its caches warm, and after something else
has evicted them, as a broker running between two messages on the same cores does.

    python -m bench.cold_cache [--passes 2000] [--evict-mb 0 8 32 64] [--without outcomes ...]

The engine without its threads (`Engine.start(background=False)`), a manual clock, one stored
message due each millisecond and a sink that answers at once (`bench/test_dispatch_bench.py`'s):
no broker, no socket. Each step is a timer pass then a dispatch pass. Before each of the two, the
step writes every cache line of an `--evict-mb` buffer (0: none, the caches stay warm). Prints the
CPU of each stage per step (the thread's CPU clock, the buffer's writing not counted).

`--without` leaves stages of the dispatch pass out (`WITHOUT`: the outcome's record whole, its
dispatch-log frame alone, the lateness observation): what the step costs without one is the most a
compiled or scalar form of it could save there, so it says which to take on first. A step without
its outcomes is not a real send (nothing records it); only the figures are meant.

Why: `bench.dispatch_pass_cost pass` measures a one-message step at about 220 µs of CPU against the
real broker, and `bench.peers` the same at 1k/s by thread (`tw-timer` about 50, `tw-dispatch` about
200), while the same step costs 30-40 µs in a hot loop. This says how much of the difference is the
engine's code and data fetched again from memory after the broker's JVM pushed them out of the
caches (bench/RESULTS_HOTPATHS.md, run 10).
"""
from __future__ import annotations

import argparse
import contextlib
import tempfile
import time
from pathlib import Path
from typing import Sequence
from unittest import mock

import numpy as np

from bench.test_dispatch_bench import T0, _InstantRecordSink
from storage import ScheduleStore
from timewheel import Engine, EngineConfig, ManualClock, Message
from timewheel._outcomes import Outcomes
from timewheel.lateness import LatenessRecorder

WARM_UP = 300
#: stages `--without` leaves out: the class and method made to do nothing
WITHOUT = {"outcomes": (Outcomes, "record"), "dispatch-log": (ScheduleStore, "record_dispatch"),
           "lateness": (LatenessRecorder, "observe")}


def _cpu() -> float:
    return time.thread_time()  # CLOCK_THREAD_CPUTIME_ID: getrusage counts whole scheduler ticks here


def steps(evict_mb: int, passes: int, without: Sequence[str] = ()) -> tuple[float, float]:
    """(timer, dispatch) µs of CPU a step, the caches evicted by `evict_mb` MB before each stage, the
    stages named in `without` (`WITHOUT`) left out."""
    junk = np.ones(max(1, evict_mb) * 2**20 // 8)
    with tempfile.TemporaryDirectory(prefix="tw-cold-") as work, contextlib.ExitStack() as stack:
        for name in without:
            cls, method = WITHOUT[name]
            stack.enter_context(mock.patch.object(cls, method, lambda *a, **k: None))
        clock = ManualClock(T0)
        engine = Engine(EngineConfig(data_dir=Path(work) / "data"), _InstantRecordSink(), clock, seed=1)
        engine.start(background=False)
        run = engine._run
        assert run is not None
        total = WARM_UP + passes
        engine.schedule([Message("T", b"x" * 200, T0 + 10 + k, msg_id=f"m{k}") for k in range(total + 10)])
        clock.advance(9)
        run.timer.run_pass(clock.now_ms())
        timer = dispatch = 0.0
        handled = 0
        for k in range(total):
            clock.advance(1)
            if evict_mb:
                junk += 1.0
            t0 = _cpu()
            run.timer.run_pass(clock.now_ms())
            t1 = _cpu()
            if evict_mb:
                junk += 1.0
            t2 = _cpu()
            handled += run.dispatcher.dispatch_pass()
            t3 = _cpu()
            if k >= WARM_UP:
                timer += t1 - t0
                dispatch += t3 - t2
        engine.stop()
    if handled != total:
        raise RuntimeError(f"{handled} messages sent in {total} steps: the steps did not send one each")
    return timer / passes * 1e6, dispatch / passes * 1e6


def main(argv: Sequence[str] | None = None) -> None:
    """Print the table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--passes", type=int, default=2000, help="steps measured per size (after 300 not measured)")
    ap.add_argument("--evict-mb", type=int, nargs="+", default=[0, 8, 32, 64],
                    help="sizes of the buffer written before each stage, MB (0: caches left warm)")
    ap.add_argument("--without", nargs="+", default=[], choices=sorted(WITHOUT),
                    help="stages of the dispatch pass left out (their cost is the most a faster form could save)")
    args = ap.parse_args(argv)
    print(f"without: {', '.join(args.without)}" if args.without else "every stage")
    print("| evicted before each stage | timer pass µs | dispatch pass µs | step µs |")
    print("| ---: | ---: | ---: | ---: |")
    for mb in args.evict_mb:
        timer, dispatch = steps(mb, args.passes, args.without)
        print(f"| {mb} MB | {timer:.1f} | {dispatch:.1f} | {timer + dispatch:.1f} |", flush=True)


if __name__ == "__main__":
    main()
