"""CPU of named stages inside a running engine, measured where they run (their thread's CPU clock).

    python -m bench.stage_cpu serve --out FILE [--every 2] -- [timewheel serve's arguments]
    python -m bench.stage_cpu timeline FILE
    python -m bench.stage_cpu table FILE --from S --to S --rate N
    python -m bench.stage_cpu slow FILE

`StageClock` wraps methods of the engine's classes for as long as it is entered, and adds up the
calling thread's CPU (`time.thread_time`) spent inside each: what a stage costs among the broker's
and the other threads' traffic, caches as they really are, which a hot-loop benchmark cannot show
(bench/RESULTS_HOTPATHS.md, runs 10 and 11). A stage called inside another is counted in both.
Each wrap adds about a microsecond of its own per call.

- serve: `timewheel serve` with every stage of `SERVE_STAGES` wrapped, writing the running totals
  to FILE every `--every` seconds (one JSON line each); `bench.peers run --stages FILE` runs its
  engine so;
- timeline: what each interval of such a file counted (pull ticks, commits, sends, CPU), to find a
  phase's seconds;
- table: each stage's CPU a message between two of those seconds, at `--rate` messages a second;
- slow: every call of a stage that took over `--slow-ms` (15) of wall time, with its thread's CPU
  and its wait for a CPU (the kernel's run queue, /proc/thread-self/schedstat) meanwhile; the rest
  of its wall time the thread slept: for the broker's answer, the disk, a lock or the GIL.
"""
from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import re
import resource
import runpy
import sys
import threading
import time
from pathlib import Path
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

__all__ = ["DELIVERY_STAGES", "INGEST_STAGES", "SEND_STAGE", "SERVE_STAGES", "StageClock", "thread_cpu"]

#: (module, class, method, label): the delivery path of `timewheel serve`, outermost first
DELIVERY_STAGES: tuple[tuple[str, str, str, str], ...] = (
    ("timewheel.timer", "TimerDriver", "_pass", "timer pass"),
    ("timewheel.dispatch_queue", "DispatchQueue", "await_turn", "queue: await turn"),
    ("timewheel.dispatcher", "Dispatcher", "dispatch_pass", "dispatch pass"),
    ("timewheel.dispatch_queue", "DispatchQueue", "take", "  queue: take"),
    ("storage.store", "ScheduleStore", "read_record_bytes", "  read and check the records"),
    ("forwarder.delivery", "RocketMQSink", "send_records", "  sink: send the records"),
    ("forwarder.record_batches", "", "cut_records", "    cut into batch bodies"),
    ("forwarder.rocketmq.producer", "RemotingProducer", "_exchange_one", "    request out, answer in"),
    ("forwarder.rocketmq.producer", "RemotingProducer", "_exchange", "    requests out, answers in (several)"),
    ("timewheel._outcomes", "Outcomes", "record", "  record the outcomes"),
)

#: the ingest path: a pull tick's answers read, walked and stored in one commit
INGEST_STAGES: tuple[tuple[str, str, str, str], ...] = (
    ("forwarder.rocketmq._puller", "Puller", "_handle_pulls", "in: a tick's answers"),
    ("forwarder.rocketmq._puller", "Puller", "_read_pull", "in:   read one pull answer"),
    ("forwarder.ingest", "DelayTopicIngest", "_store_answers", "in:   store the answers"),
    ("timewheel.engine", "Engine", "schedule_encoded", "in:     engine: schedule"),
    ("storage.store", "ScheduleStore", "_commit_locked", "in:       store: commit"),
    ("storage.meta", "MetaStore", "locations", "in:         id index: look up"),
    ("storage.ingest_log", "IngestLog", "append", "in:         ingest log"),
    ("storage._writer", "PartWriter", "write", "in:         write parts"),
    ("storage.meta", "MetaStore", "put_records", "in:         id index: put"),
)

#: how often a reader maps a part again (a live part grown past its map)
READ_STAGES: tuple[tuple[str, str, str, str], ...] = (
    ("storage.part", "PartReader", "whole", "read: map a part again"),
)

#: a stage's call longer than this (wall ms) is listed by `serve` with its CPU (`slow`)
SLOW_MS = 15.0
#: stages that wait by design (for work to come due): never listed as slow
WAITS = frozenset(label for _, _, method, label in DELIVERY_STAGES if method == "await_turn")
#: what `serve` wraps
SERVE_STAGES = DELIVERY_STAGES + INGEST_STAGES + READ_STAGES
#: the stage called once a send (its calls count the sends)
SEND_STAGE = DELIVERY_STAGES[3][3]
_TICKS, _COMMITS, _SENDS = INGEST_STAGES[0][3], INGEST_STAGES[4][3], SEND_STAGE


class StageClock:
    """Adds up each wrapped stage's CPU on the calling thread, while entered."""

    def __init__(self, stages: Iterable[tuple[str, str, str, str]] = DELIVERY_STAGES, slow_ms: float | None = None
                 ) -> None:
        """`stages`: (module, class or "" for a module function, method, label); `slow_ms`: also keep each
        call that took longer than this (wall time) in `slow`, with its thread's CPU meanwhile."""
        self.stages = tuple(stages)
        self.cpu: defaultdict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self.slow_ms = slow_ms
        #: (time.time() at the end, thread name, label, wall ms, thread CPU ms, run-queue wait ms) of each
        #: slow call
        self.slow: list[tuple[float, str, str, float, float, float]] = []
        self._lock = threading.Lock()
        self._undo: list[Callable[[], None]] = []

    def __enter__(self) -> "StageClock":
        for module, cls, method, label in self.stages:
            mod = importlib.import_module(module)
            owner: Any = getattr(mod, cls) if cls else mod
            original = getattr(owner, method)
            setattr(owner, method, self._timed(original, label))
            self._undo.append(functools.partial(setattr, owner, method, original))
            if not cls:  # a module function may be imported by name elsewhere: rebind those too
                self._rebind_importers(original, label)
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        while self._undo:
            self._undo.pop()()

    def _rebind_importers(self, original: Callable[..., Any], label: str) -> None:
        for mod in list(sys.modules.values()):
            for name, value in list(getattr(mod, "__dict__", {}).items()):
                if value is original:
                    setattr(mod, name, self._timed(original, label))
                    self._undo.append(functools.partial(setattr, mod, name, original))

    def _timed(self, fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        cpu, calls, lock = self.cpu, self.calls, self._lock

        slow_s = None if self.slow_ms is None or label in WAITS else self.slow_ms / 1000
        slow = self.slow

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            q0 = run_queue_ns() if slow_s is not None else 0
            t0, w0 = time.thread_time(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent, wall = time.thread_time() - t0, time.perf_counter() - w0
                queued = run_queue_ns() - q0 if slow_s is not None and wall > slow_s else 0
                with lock:
                    cpu[label] += spent
                    calls[label] += 1
                    if slow_s is not None and wall > slow_s:
                        slow.append((round(time.time(), 3), threading.current_thread().name, label,
                                     round(wall * 1000, 1), round(spent * 1000, 2), round(queued / 1e6, 2)))
        return timed

    def reset(self) -> None:
        """Forget what was counted so far (the measured window starts now)."""
        with self._lock:
            self.cpu.clear()
            self.calls.clear()

    def table(self, per: int, unit: str) -> str:
        """Each stage's CPU per `per` (µs a `unit`), and per call, in the order the stages were named."""
        lines = [f"{'stage':34s} {'µs a ' + unit:>12s} {'calls':>8s} {'µs a call':>10s}"]
        for _, _, _, label in self.stages:
            n = self.calls[label]
            if n:
                lines.append(f"{label:34s} {self.cpu[label] / per * 1e6:12.1f} {n:8d} {self.cpu[label] / n * 1e6:10.1f}")
        return "\n".join(lines)


_schedstat = threading.local()


def run_queue_ns() -> int:
    """Nanoseconds the calling thread has waited in the kernel's run queue for a CPU so far (its
    /proc/thread-self/schedstat; 0 where the kernel keeps none)."""
    fd = getattr(_schedstat, "fd", None)
    if fd is None:
        try:
            fd = _schedstat.fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
        except OSError:
            fd = _schedstat.fd = -1
    if fd < 0:
        return 0
    return int(os.pread(fd, 128, 0).split()[1])


def thread_cpu() -> dict[str, tuple[float, float]]:
    """(user, system) CPU seconds of each live Python thread of this process, by its name (Linux
    /proc, in clock ticks; threads of one name added up)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, tuple[float, float]] = {}
    for t in threading.enumerate():
        try:
            fields = Path(f"/proc/self/task/{t.native_id}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        user, system = out.get(t.name, (0.0, 0.0))
        out[t.name] = (user + int(fields[11]) / tick, system + int(fields[12]) / tick)
    return out


def _thread_groups() -> dict[str, float]:
    """`thread_cpu`, user and system together, by name without a trailing number (the four
    `timewheel-dispatch-N` as one)."""
    out: dict[str, float] = defaultdict(float)
    for name, (user, system) in thread_cpu().items():
        out[re.sub(r"-\d+$", "", name)] += user + system
    return dict(out)


def _snapshots(clock: StageClock, out: Path, every: float) -> None:
    """Append the running totals to `out` every `every` seconds (the thread is a daemon)."""
    with out.open("a") as f:
        while True:
            time.sleep(every)
            with clock._lock:
                snap = {"t": round(time.time(), 3), "cpu": dict(clock.cpu), "calls": dict(clock.calls),
                        "threads": _thread_groups(), "process": time.process_time(),
                        "minor_faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt, "slow": clock.slow[:]}
                clock.slow.clear()
            f.write(json.dumps(snap) + "\n")
            f.flush()


def _serve(out: Path, every: float, args: list[str], slow_ms: float = SLOW_MS) -> None:
    """`timewheel serve` in this process, its stages wrapped before it starts."""
    clock = StageClock(SERVE_STAGES, slow_ms=slow_ms)
    clock.__enter__()  # for the process's life: it ends with the service
    threading.Thread(target=_snapshots, args=(clock, out, every), name="stage-snapshots", daemon=True).start()
    sys.argv = ["timewheel", "serve", *args]
    runpy.run_module("timewheel", run_name="__main__", alter_sys=True)


def _load(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _delta(a: dict[str, Any], b: dict[str, Any], key: str) -> dict[str, float]:
    return {k: v - a[key].get(k, 0) for k, v in b[key].items()}


def timeline(path: Path) -> str:
    """Per interval of a snapshot file: seconds from its start, pull ticks, commits, sends, and the
    CPU (ms) of the ingest ticks, dispatch passes and timer passes."""
    snaps = _load(path)
    if len(snaps) < 2:
        return "fewer than two snapshots"
    t0 = min([snaps[0]["t"], *(c[0] for snap in snaps for c in snap.get("slow", []))])
    lines = [f"{'s':>6s} {'ticks':>6s} {'commits':>8s} {'sends':>6s} {'in ms':>7s} {'dispatch ms':>12s} {'timer ms':>9s}"]
    for a, b in zip(snaps, snaps[1:]):
        c, d = _delta(a, b, "calls"), _delta(a, b, "cpu")
        lines.append(f"{b['t'] - t0:6.0f} {c.get(_TICKS, 0):6.0f} {c.get(_COMMITS, 0):8.0f} {c.get(_SENDS, 0):6.0f} "
                     f"{d.get(_TICKS, 0) * 1e3:7.0f} {d.get('dispatch pass', 0) * 1e3:12.0f} "
                     f"{d.get('timer pass', 0) * 1e3:9.0f}")
    return "\n".join(lines)


def table(path: Path, start_s: float, end_s: float, rate: float) -> str:
    """Each stage's CPU a message (at `rate` a second) and a call between two seconds of the file."""
    snaps = _load(path)
    t0 = snaps[0]["t"]
    a = min(snaps, key=lambda s: abs(s["t"] - t0 - start_s))
    b = min(snaps, key=lambda s: abs(s["t"] - t0 - end_s))
    secs = b["t"] - a["t"]
    if secs <= 0:
        raise SystemExit(f"no interval between {start_s} and {end_s} s: see `timeline`")
    c, d = _delta(a, b, "calls"), _delta(a, b, "cpu")
    n = rate * secs
    lines = [f"{secs:.0f} s at {rate:,.0f} a second: {c.get(_SENDS, 0):,.0f} sends, {c.get(_COMMITS, 0):,.0f} commits",
             f"{'stage':40s} {'µs a message':>13s} {'µs a call':>10s} {'calls a s':>10s}"]
    for _, _, _, label in SERVE_STAGES:
        if c.get(label):
            spent = d.get(label, 0.0)
            lines.append(f"{label:40s} {spent / n * 1e6:13.2f} {spent / c[label] * 1e6:10.1f} "
                         f"{c[label] / secs:10.1f}")
    if "minor_faults" in a and "minor_faults" in b:
        lines.append(f"{'minor page faults a message':40s} {(b['minor_faults'] - a['minor_faults']) / n:13.2f}")
    if "threads" in a and "threads" in b:  # the whole threads, staged or not, for comparison
        lines.append(f"{'thread (all it ran)':40s} {'µs a message':>13s}")
        lines.append(f"{'the process':40s} {(b['process'] - a['process']) / n * 1e6:13.2f}")
        for name, spent in sorted(_delta(a, b, "threads").items(), key=lambda kv: -kv[1]):
            if spent > 0:
                lines.append(f"{name:40s} {spent / n * 1e6:13.2f}")
    return "\n".join(lines)


def slow_calls(path: Path) -> str:
    """Each slow call a snapshot file lists: seconds from its first snapshot, thread, stage, and in ms
    its wall time, its CPU, its wait for a CPU (the run queue; "-" in files written before it was kept)
    and the rest, asleep (for the broker's answer, the disk, a lock or the GIL); then the totals."""
    snaps = _load(path)
    if not snaps:
        return "(no snapshots)"
    t0 = min([snaps[0]["t"], *(c[0] for snap in snaps for c in snap.get("slow", []))])
    lines = [f"{'s':>8s}  {'thread':28s} {'stage':40s} {'wall ms':>8s} {'CPU ms':>7s} {'run queue':>9s} "
             f"{'asleep':>7s}"]
    total = [0.0, 0.0, 0.0, 0.0]
    for snap in snaps:
        for t, thread, label, wall, cpu, *rest in snap.get("slow", []):
            queued = rest[0] if rest else None
            asleep = wall - cpu - (queued or 0.0)
            total = [total[0] + wall, total[1] + cpu, total[2] + (queued or 0.0), total[3] + asleep]
            lines.append(f"{t - t0:8.2f}  {thread:28s} {label.strip():40s} {wall:8.1f} {cpu:7.2f} "
                         f"{'-' if queued is None else f'{queued:.2f}':>9s} {asleep:7.1f}")
    lines.append(f"{'':8s}  {'all':28s} {f'{len(lines) - 1} calls':40s} {total[0]:8.1f} {total[1]:7.2f} "
                 f"{total[2]:9.2f} {total[3]:7.1f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Entry point."""
    ap = argparse.ArgumentParser(prog="python -m bench.stage_cpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="timewheel serve with its stages timed (arguments after --)")
    s.add_argument("--out", type=Path, required=True, help="JSON lines of running totals, appended")
    s.add_argument("--every", type=float, default=2.0, help="seconds between snapshots")
    s.add_argument("--slow-ms", type=float, default=SLOW_MS,
                   help="list each stage's call longer than this (wall ms) with its CPU (default %(default)s)")
    s.add_argument("serve_args", nargs=argparse.REMAINDER, help="timewheel serve's own arguments, after --")
    w = sub.add_parser("slow", help="the slow calls a snapshot file lists (wall time and CPU of each)")
    w.add_argument("file", type=Path)
    t = sub.add_parser("timeline", help="what each interval of a snapshot file counted")
    t.add_argument("file", type=Path)
    b = sub.add_parser("table", help="each stage's CPU a message between two seconds of a snapshot file")
    b.add_argument("file", type=Path)
    b.add_argument("--from", dest="start", type=float, required=True, help="seconds from the file's first snapshot")
    b.add_argument("--to", dest="end", type=float, required=True)
    b.add_argument("--rate", type=float, required=True, help="messages a second meanwhile")
    args = ap.parse_args(argv)
    if args.cmd == "serve":
        rest = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
        _serve(args.out, args.every, rest, args.slow_ms)
    elif args.cmd == "slow":
        print(slow_calls(args.file))
    elif args.cmd == "timeline":
        print(timeline(args.file))
    else:
        print(table(args.file, args.start, args.end, args.rate))


if __name__ == "__main__":
    main()
