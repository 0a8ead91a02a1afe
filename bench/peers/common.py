"""What every system's adapter and every workload share: messages, recording, percentiles, processes."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

#: Where the JSON, the chart and RESULTS.md go.
RESULTS_DIR = Path(__file__).resolve().parent.parent / "results"
RESULTS_MD = Path(__file__).resolve().parent.parent / "RESULTS.md"


@dataclass(frozen=True, slots=True)
class BenchMessage:
    """One message of a workload: a unique id, the wanted due time (epoch ms) and a body."""

    id: int
    due_ms: int
    body: bytes


#: Called by a system when a message reaches its consumer: (id, wanted due ms; fractional for the plain hop,
#: whose "due" is its send time).
Deliver = Callable[[int, float], None]


def now_ms() -> int:
    """Wall-clock epoch milliseconds (the clock every due time and receive time uses)."""
    return time.time_ns() // 1_000_000


class Recorder:
    """Receive times of one phase: the first arrival of each id counts, later ones are duplicates."""

    def __init__(self, wanted: Iterable[int] | None = None) -> None:
        """Record everything, or only ids in `wanted` (others are counted as `other`)."""
        self.lock = threading.Lock()
        self.wanted = set(wanted) if wanted is not None else None
        self.ids: list[int] = []
        self.due_ms: list[float] = []
        self.recv_ns: list[int] = []
        self.seen: set[int] = set()
        self.duplicates = 0
        self.other = 0
        self.arrived = threading.Condition(self.lock)

    def record(self, msg_id: int, due_ms: float) -> None:
        """Note that `msg_id`, due at `due_ms`, has just arrived."""
        t = time.time_ns()
        with self.lock:
            if self.wanted is not None and msg_id not in self.wanted:
                self.other += 1
                return
            if msg_id in self.seen:
                self.duplicates += 1
                return
            self.seen.add(msg_id)
            self.ids.append(msg_id)
            self.due_ms.append(due_ms)
            self.recv_ns.append(t)
            self.arrived.notify_all()

    @property
    def count(self) -> int:
        """Distinct messages received."""
        with self.lock:
            return len(self.ids)

    def first_ns(self) -> int | None:
        """When the first message arrived."""
        with self.lock:
            return self.recv_ns[0] if self.recv_ns else None

    def last_ns(self) -> int | None:
        """When the latest message arrived."""
        with self.lock:
            return self.recv_ns[-1] if self.recv_ns else None

    def lateness_ms(self) -> np.ndarray:
        """Receive time minus wanted due time, per message, in ms."""
        with self.lock:
            return np.asarray(self.recv_ns, np.int64) / 1e6 - np.asarray(self.due_ms, np.float64)

    def wait_count(self, n: int, timeout: float, idle: float | None = None) -> bool:
        """Wait until `n` messages arrived; give up at `timeout`, or after `idle` s without an arrival."""
        deadline = time.monotonic() + timeout
        last_change, last_count = time.monotonic(), -1
        with self.lock:
            while len(self.ids) < n:
                now = time.monotonic()
                if len(self.ids) != last_count:
                    last_change, last_count = now, len(self.ids)
                if now >= deadline or (idle is not None and now - last_change >= idle):
                    return False
                self.arrived.wait(min(0.2, deadline - now))
            return True


def percentiles(late_ms: np.ndarray) -> dict[str, float | int]:
    """p50, p99, p999, max, min and count of lateness values (ms)."""
    if not len(late_ms):
        return {"count": 0}
    p = np.percentile(late_ms, [50, 99, 99.9])
    return {"p50": round(float(p[0]), 2), "p99": round(float(p[1]), 2), "p999": round(float(p[2]), 2),
            "max": round(float(late_ms.max()), 2), "min": round(float(late_ms.min()), 2), "count": int(len(late_ms))}


def percentiles_of_quantiles(quantiles: list[float], count: int) -> dict[str, float | int]:
    """`percentiles` read off 1001 quantiles (0, 0.1, ... 100 %) computed elsewhere (RocketMQ's Java consumer)."""
    if not quantiles or not count:
        return {"count": 0}
    return {"p50": round(quantiles[500], 2), "p99": round(quantiles[990], 2), "p999": round(quantiles[999], 2),
            "max": round(quantiles[1000], 2), "min": round(quantiles[0], 2), "count": count}


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(pred: Callable[[], bool], timeout: float, step: float = 0.01) -> bool:
    """Poll `pred` until it holds or `timeout` passes; return its last answer."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(step)
    return pred()


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (0 if it is gone)."""
    import psutil  # the bench extra: the harness's modules import without it

    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def dir_bytes(path: Path) -> int:
    """Bytes of the regular files under `path` (apparent sizes)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def dir_allocated_bytes(path: Path) -> int:
    """Bytes the files under `path` occupy on disk (blocks), which is what sparse mapped files cost."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


def terminate(proc: subprocess.Popen[bytes], timeout: float = 15.0) -> None:
    """SIGTERM a process we started, SIGKILL it after `timeout`, and reap it."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def remove_tree(path: Path) -> None:
    """Delete a directory tree, ignoring what is already gone."""
    shutil.rmtree(path, ignore_errors=True)


def not_a_checkout(tree: Path) -> str | None:
    """Why `tree` cannot give a `timewheel serve` to measure (another revision's engine), or None."""
    if (tree / "timewheel" / "__main__.py").is_file():
        return None
    return f"{tree} is not a timewheel checkout (no timewheel/__main__.py)"


def _stat_cpu_seconds(stat: Path) -> tuple[float, float]:
    """(user, system) CPU seconds in a /proc `stat` file (a process's or a thread's)."""
    fields = stat.read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def process_cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds process `pid` has used so far, from /proc (no psutil: only the
    `bench` extra installs it); OSError once the process is gone."""
    return _stat_cpu_seconds(Path(f"/proc/{pid}/stat"))


def thread_usage(pid: int) -> dict[int, tuple[str, float, int]]:
    """Per thread of process `pid`, by its id: (the name it gave the OS, CPU seconds so far, user and
    system; how many times it went to sleep of its own accord, a wait or a blocking call:
    `voluntary_ctxt_switches`). A thread that ends meanwhile is left out. By id, not name: a thread
    renamed between two readings (`timewheel serve` names its threads as they start) is the same."""
    out: dict[int, tuple[str, float, int]] = {}
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            name = (task / "comm").read_text().strip()
            cpu = sum(_stat_cpu_seconds(task / "stat"))
            status = (task / "status").read_text()
        except OSError:
            continue
        sleeps = int(status.split("\nvoluntary_ctxt_switches:", 1)[1].split()[0])
        out[int(task.name)] = (name, cpu, sleeps)
    return out


def usage_between(before: dict[int, tuple[str, float, int]], after: dict[int, tuple[str, float, int]]
                  ) -> dict[int, tuple[str, float, int]]:
    """What each thread of `after` (a `thread_usage` reading) did since `before`, by id, under its name in
    `after`: (name, CPU seconds, sleeps). One started in between counts whole; one ended in between is
    not in `after`."""
    out = {}
    for tid, (name, cpu, sleeps) in after.items():
        _, cpu0, sleeps0 = before.get(tid, (name, 0.0, 0))
        out[tid] = (name, cpu - cpu0, sleeps - sleeps0)
    return out
