"""CPU seconds of a system's processes and of the engine's threads, read once or sampled through a phase."""
from __future__ import annotations

import re
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from bench.peers.common import thread_usage, usage_between

if TYPE_CHECKING:
    from bench.peers.systems import System


def cpu_seconds(system: System) -> dict[str, float]:
    """User + system CPU seconds of each process doing the system's work (children included), by name."""
    import psutil

    out: dict[str, float] = {}
    for pid in system.process_pids():
        try:
            proc = psutil.Process(pid)
            procs = [proc, *proc.children(recursive=True)]
            name = "broker" if any("BrokerStartup" in a for a in proc.cmdline()) else proc.name()
            total = 0.0
            for p in procs:
                t = p.cpu_times()
                total += t.user + t.system
            out[f"{pid} {name}"] = total
        except psutil.Error:
            pass
    return out


def run_queue_seconds(system: System) -> dict[str, float]:
    """Seconds the threads of each process doing the system's work (children included) have waited in
    the kernel's run queue for a CPU (their /proc schedstat), keyed as `cpu_seconds`: on a machine the
    broker, the clients and the engine share, what the scheduler, not the work, added to a wait."""
    out: dict[str, float] = {}
    for pid in system.process_pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            name = "broker" if any(b"BrokerStartup" in a for a in argv) else Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:  # the process ended
            continue
        waited = 0
        for p in _process_tree(pid):
            for task in Path(f"/proc/{p}/task").glob("*"):
                try:
                    waited += int((task / "schedstat").read_text().split()[1])
                except (OSError, IndexError, ValueError):  # the thread ended, or no schedstat here
                    continue
        out[f"{pid} {name}"] = waited / 1e9
    return out


def _process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (/proc's children lists)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except (OSError, ValueError):
                continue
    return out


#: one reading of the engine's threads: by thread id, `thread_usage`'s (name, CPU seconds, sleeps)
ThreadReadings = dict[int, tuple[str, float, int]]


def thread_readings(system: System) -> ThreadReadings:
    """Every thread of the engine's processes, by thread id (`thread_usage`); empty for other systems.
    Differences are taken by id (`threads_between`): a thread named between two readings is charged
    only what it did after the first."""
    out: ThreadReadings = {}
    if system.name != "timewheel":
        return out
    for pid in system.process_pids():
        try:
            out.update(thread_usage(pid))
        except OSError:  # the process ended meanwhile
            continue
    return out


def _group(name: str) -> str | None:
    """The engine thread group a thread name belongs to (`tw-dispatch-0` -> `tw-dispatch`, every
    `tw-in-BROKER` -> `tw-in`); None for the broker's threads and the runtime's own."""
    if not name.startswith("tw-"):
        return None
    return "tw-in" if name.startswith("tw-in-") else re.sub(r"-\d+$", "", name)


def threads_between(before: ThreadReadings, after: ThreadReadings) -> dict[str, float]:
    """CPU seconds each engine thread group spent from `before` to `after`, thread by thread
    (`usage_between`: one ended in between is not in `after`, so sample often enough)."""
    out: dict[str, float] = {}
    for name, cpu, _ in usage_between(before, after).values():
        group = _group(name)
        if group is not None:
            out[group] = out.get(group, 0.0) + cpu
    return out


class CpuSampler:
    """Samples `cpu_seconds` and `thread_readings` of a system every `every_s` in a thread of its own,
    so that a phase's steady part can be told from its ramp and drain (`window`)."""

    def __init__(self, system: System, every_s: float = 0.5) -> None:
        self.system = system
        self.every_s = every_s
        #: (time.monotonic(), cpu_seconds, thread_readings, run_queue_seconds)
        self.samples: list[tuple[float, dict[str, float], ThreadReadings, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-sampler", daemon=True)

    def __enter__(self) -> CpuSampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _sample(self) -> None:
        self.samples.append((time.monotonic(), cpu_seconds(self.system), thread_readings(self.system),
                             run_queue_seconds(self.system)))

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self._sample()

    def window(self, start: float, end: float) -> dict[str, object] | None:
        """CPU spent between the samples nearest `start` and `end` (time.monotonic()); None if the
        window holds fewer than two samples. The engine's threads are charged sample to sample, by
        thread id: one named or ended inside the window is charged what it did there (to its last sample)."""
        inside = [s for s in self.samples if start - self.every_s / 2 <= s[0] <= end + self.every_s / 2]
        if len(inside) < 2:
            return None
        (t0, c0, _, q0), (t1, c1, _, q1) = inside[0], inside[-1]
        threads: dict[str, float] = {}
        for (_, _, h0, _), (_, _, h1, _) in zip(inside, inside[1:]):
            for k, v in threads_between(h0, h1).items():
                threads[k] = threads.get(k, 0.0) + v
        return {"seconds": round(t1 - t0, 2),
                "server_cpu_s": {k: round(v - c0.get(k, 0.0), 3) for k, v in c1.items()},
                "engine_threads_cpu_s": {k: round(v, 3) for k, v in sorted(threads.items()) if v > 0},
                "run_queue_s": {k: round(v - q0.get(k, 0.0), 3) for k, v in q1.items()}}


def window_cpu(system: dict, phase: str) -> tuple[float, float, float] | None:
    """(engine CPU s, broker CPU s, messages at the nominal rate) of a phase's steady window
    (`steady_window`), None when the run lacks one."""
    p = system.get(phase) or {}
    w = p.get("steady_window") or {}
    cpu, seconds, rate = w.get("server_cpu_s"), w.get("seconds"), p.get("rate")
    if not isinstance(cpu, dict) or not cpu or not seconds or not isinstance(rate, int):
        return None
    engine = sum(v for k, v in cpu.items() if "broker" not in k)
    return engine, sum(cpu.values()) - engine, rate * float(seconds)


def steady_window(sampler: CpuSampler, paced_until: float, stream_s: float, delay_max_s: float
                  ) -> dict[str, object] | None:
    """The CPU of the phase's steady part: the last seconds of the stream, once what it sends comes due at
    the full rate (the longest delay after it began, plus 2 s of slack), to the producer's end. The rest
    of the phase is the ramp (storing only) and the drain (delivering at a falling rate, where a send
    carries fewer messages and costs more each); the whole phase's figures keep both."""
    seconds = stream_s - delay_max_s - 2
    if seconds < 2:
        return None
    return sampler.window(paced_until - seconds, paced_until)
