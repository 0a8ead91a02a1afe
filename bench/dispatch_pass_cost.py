"""What one send costs the engine, through a real local RocketMQ.

    python -m bench.dispatch_pass_cost pass [--per-send 1] [--passes 1500] [--profile]
    python -m bench.dispatch_pass_cost threads [--rate 1000] [--seconds 10] [--send-linger-ms N] [--shaper]
        [--cancel-every K] [--stages]

- pass: the engine without its threads (`Engine.start(background=False)`), a manual clock, and
  stored messages `--per-send` to a millisecond; one timer pass and one dispatch pass per step,
  against the real broker. Prints CPU (user and system) and wall time per pass and, per call,
  the CPU and wall time of the socket write; `--profile` adds cProfile's top functions.
  `bench/test_dispatch_bench.py` is the same pass against a sink that answers at once.
- threads: the engine with its threads and a real clock; `--rate` messages a second come due for
  `--seconds`. Prints the process's CPU per message and each thread's (no ingest beside it);
  `--stages` adds each delivery stage's CPU a send, where it ran (`bench.stage_cpu`).
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import resource
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Sequence

from forwarder import LocalRocketMQ
from forwarder.config import RocketMQConfig
from forwarder.delivery import RocketMQSink
from forwarder.rocketmq import RemotingProducer
from forwarder.rocketmq.connection import Connection
from forwarder.shaping import TrafficShaper
from bench.stage_cpu import SEND_STAGE, StageClock, thread_cpu
from timewheel import Clock, Engine, EngineConfig, ManualClock, Message, SystemClock
from timewheel.cancels import CancelRequest

TOPIC = "BENCH_PASS"


def _engine(mq: LocalRocketMQ, data: Path, clock: Clock, linger_ms: int | None = None,
            shaper: bool = False) -> tuple[Engine, RemotingProducer]:
    cfg = RocketMQConfig(namesrv=mq.namesrv_addr)
    if linger_ms is not None:
        cfg = replace(cfg, send_linger_ms=linger_ms, send_linger_max_ms=max(linger_ms, cfg.send_linger_max_ms))
    dead_letters = RemotingProducer(mq.namesrv_addr, "bench-pass-dl")
    return Engine(EngineConfig(data_dir=data), RocketMQSink(cfg, dead_letters), clock, seed=1,
                  shaper=TrafficShaper() if shaper else None), dead_letters


def run_passes(mq: LocalRocketMQ, data: Path, per_send: int, passes: int, profile: bool) -> None:
    """Timer and dispatch passes by hand; CPU and wall time per pass, and of the socket write."""
    t0 = int(time.time() * 1000)
    clock = ManualClock(t0)
    engine, dead_letters = _engine(mq, data, clock)
    engine.start(background=False)
    run = engine._run
    assert run is not None
    warm = 300
    engine.schedule([Message(TOPIC, b"x" * 200, t0 + 1 + k // per_send, msg_id=f"m{k}")
                     for k in range((warm + 2 * passes) * per_send)])
    writes = [0.0, 0.0, 0]  # CPU s, wall s, calls
    submit = Connection.submit

    def timed_submit(self: Connection, *a: object, **k: object) -> list[int]:
        c, w = time.thread_time(), time.perf_counter()
        try:
            return submit(self, *a, **k)  # type: ignore[arg-type]
        finally:
            writes[0] += time.thread_time() - c
            writes[1] += time.perf_counter() - w
            writes[2] += 1

    def loop(n: int) -> None:
        for _ in range(n):
            clock.advance(1)
            run.timer.run_pass(clock.now_ms())
            run.dispatcher.dispatch_pass()

    Connection.submit = timed_submit  # type: ignore[method-assign]
    try:
        loop(warm)
        writes[:] = [0.0, 0.0, 0]
        r0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        loop(passes)
        r1, w1 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        print(f"{passes} passes of {per_send}: user {(r1.ru_utime - r0.ru_utime) / passes * 1e6:.1f} µs, "
              f"system {(r1.ru_stime - r0.ru_stime) / passes * 1e6:.1f} µs, wall {(w1 - w0) / passes * 1e6:.1f} µs "
              f"a pass; voluntary context switches {r1.ru_nvcsw - r0.ru_nvcsw}")
        print(f"socket write (Connection.submit): CPU {writes[0] / max(1, writes[2]) * 1e6:.1f} µs, "
              f"wall {writes[1] / max(1, writes[2]) * 1e6:.1f} µs a call, {writes[2]} calls")
        if profile:
            # thread CPU time: the waits for the broker are not the engine's cost
            prof = cProfile.Profile(time.thread_time_ns, 1e-9)
            prof.enable()
            loop(passes)
            prof.disable()
            stats = pstats.Stats(prof).sort_stats(os.environ.get("PROFILE_SORT", "tottime"))
            stats.print_stats(int(os.environ.get("PROFILE_TOP", "30")))
            if os.environ.get("PROFILE_CALLERS"):  # a regular expression: who calls the functions it matches
                stats.print_callers(os.environ["PROFILE_CALLERS"])
    finally:
        Connection.submit = submit  # type: ignore[method-assign]
        engine.stop()
        dead_letters.close()


def run_threads(mq: LocalRocketMQ, data: Path, rate: int, seconds: float, linger_ms: int | None = None,
                shaper: bool = False, cancel_every: int = 0, stages: bool = False) -> None:
    """Messages due at `rate` a second through the engine's own threads; CPU per message by thread.
    `cancel_every` k: every k-th message is cancelled once loaded, a thousand cancels at a time;
    `stages`: also the CPU of each delivery stage where it runs (`bench.stage_cpu`)."""
    clock = StageClock() if stages else None
    with clock or contextlib.nullcontext():
        _run_threads(mq, data, rate, seconds, linger_ms, shaper, cancel_every, clock)


def _run_threads(mq: LocalRocketMQ, data: Path, rate: int, seconds: float, linger_ms: int | None,
                 shaper: bool, cancel_every: int, stages: StageClock | None) -> None:
    engine, dead_letters = _engine(mq, data, SystemClock(), linger_ms, shaper)
    engine.start()
    run = engine._run
    assert run is not None
    n = int(rate * seconds)
    first = int(time.time() * 1000) + 3000
    # one message ahead, out of the count: the sink's first send opens its connection and reads the routes
    engine.schedule([Message(TOPIC, b"x" * 200, first - 1500, msg_id="warm-up")])
    engine.schedule([Message(TOPIC, b"x" * 200, first + k * 1000 // rate, msg_id=f"m{k}") for k in range(n)])
    if cancel_every:
        time.sleep(0.5)  # the current segment is loaded: the cancels reach the wheel and the queue
        ids = [f"m{k}" for k in range(0, n, cancel_every)]
        t0 = time.process_time()
        for i in range(0, len(ids), 1000):
            engine.apply_cancels([CancelRequest(m, None, first) for m in ids[i:i + 1000]])
        print(f"{len(ids):,} cancels applied: {(time.process_time() - t0) / len(ids) * 1e6:.1f} µs of CPU each")
        n -= len(ids)
    time.sleep(max(0.0, first / 1000 - time.time()))
    if stages is not None:
        stages.reset()
    c0, p0, r0 = thread_cpu(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(seconds + 0.5)
    c1, p1, r1 = thread_cpu(), time.process_time(), resource.getrusage(resource.RUSAGE_SELF)
    delivered = engine.stats().counters.delivered - 1  # the warm-up message
    print(f"{delivered:,} of {n:,} delivered at {rate:,}/s; lateness {engine.stats().lateness_ms}; "
          f"passes on the timer's thread {engine.stats().counters.timer_thread_passes:,}")
    print(f"process CPU a message: {(p1 - p0) / n * 1e6:.1f} µs (user {(r1.ru_utime - r0.ru_utime) / n * 1e6:.1f}, "
          f"system {(r1.ru_stime - r0.ru_stime) / n * 1e6:.1f})")
    spent = {name: (u - c0.get(name, (0.0, 0.0))[0], k - c0.get(name, (0.0, 0.0))[1]) for name, (u, k) in c1.items()}
    for name in sorted(spent, key=lambda k: -sum(spent[k])):
        user, system = spent[name]
        if user + system > 0:
            print(f"  {name:30s} {(user + system) / n * 1e6:8.1f} µs a message (user {user / n * 1e6:.1f}, "
                  f"system {system / n * 1e6:.1f})")
    if stages is not None:
        sends = stages.calls[SEND_STAGE]
        print(f"by stage, where it ran ({sends:,} sends, {n / max(1, sends):.1f} messages a send):")
        print(stages.table(max(1, sends), "send"))
    engine.stop()
    dead_letters.close()


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    p = sub.add_parser("pass", help="timer and dispatch passes by hand, against the real broker")
    p.add_argument("--per-send", type=int, default=1, help="messages due each millisecond (one send)")
    p.add_argument("--passes", type=int, default=1500, help="passes measured")
    p.add_argument("--profile", action="store_true", help="also print cProfile's top functions")
    t = sub.add_parser("threads", help="the engine's threads and real clock; CPU by thread")
    t.add_argument("--rate", type=int, default=1000, help="messages due a second")
    t.add_argument("--seconds", type=float, default=10.0, help="for how long")
    t.add_argument("--send-linger-ms", type=int, help="the sink's send linger when quiet (default: the product's)")
    t.add_argument("--shaper", action="store_true", help="with a traffic shaper without rules, as `timewheel serve` runs")
    t.add_argument("--cancel-every", type=int, default=0, metavar="K",
                   help="cancel every K-th message once loaded (0: none)")
    t.add_argument("--stages", action="store_true",
                   help="also each delivery stage's CPU a send where it runs (bench.stage_cpu: about 1 µs a call more)")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="tw-pass-"))
    mq = LocalRocketMQ(work / "mq", stop_timeout=3.0)
    mq.start()
    try:
        mq.create_topics([TOPIC], queues=8)
        if args.what == "pass":
            run_passes(mq, work / "data", args.per_send, args.passes, args.profile)
        else:
            run_threads(mq, work / "data", args.rate, args.seconds, args.send_linger_ms, args.shaper,
                        args.cancel_every, args.stages)
    finally:
        mq.stop()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
