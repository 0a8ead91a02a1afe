"""What an admin request costs the engine: its CPU for each GET /metrics, /status and /healthz.

    python -m bench.admin_cost [--requests 300] [--idle-seconds 20] [--profile FILE]

Starts a local RocketMQ and `timewheel serve` on it (idle: no message flows), sends `--requests`
requests of each path one after another, and prints the serve process's CPU (user + system, from
/proc) a request, its idle CPU a second beside it, and the answer's size. A scrape runs under the
interpreter's lock: what it costs, every engine thread waits for. Then, over `--idle-seconds`
with no request, each thread's CPU a second and how often it woke (its voluntary context
switches): an idle engine's cost is its threads' periodic wakes, and a wake in a process that
shares its cores costs far more than the same code in a hot loop (its caches are cold).
`--profile` also records the serve process with py-spy while /metrics is scraped without a pause
(raw collapsed stacks: `python -m bench.profile_summary FILE --active`).
"""
from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Sequence

from bench.peers.common import process_cpu_seconds, thread_usage, usage_between
from forwarder import LocalRocketMQ
from tests.ports import free_port
from tests.reliability.kill_loop import serve_env, start_serve

PATHS = ("/metrics", "/status", "/healthz")
_WARM_UP = 20


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    return sum(process_cpu_seconds(pid))


def measure(base: str, pid: int, requests: int) -> list[tuple[str, float, int]]:
    """(path, the process's CPU ms a request, answer bytes) for each of PATHS."""
    rows = []
    for path in PATHS:
        for _ in range(_WARM_UP):
            urllib.request.urlopen(base + path, timeout=5).read()
        before = _cpu_s(pid)
        size = 0
        for _ in range(requests):
            size = len(urllib.request.urlopen(base + path, timeout=5).read())
        rows.append((path, (_cpu_s(pid) - before) / requests * 1e3, size))
    return rows


def idle_threads(pid: int, seconds: float) -> list[tuple[str, float, float]]:
    """(thread name, CPU ms a second, wakes a second) of the threads of `pid` that ran or woke over
    `seconds` (the caller sends nothing meanwhile), threads of one name summed, the dearest first."""
    before = thread_usage(pid)
    time.sleep(seconds)
    by_name: dict[str, tuple[float, int]] = {}
    for name, cpu, sleeps in usage_between(before, thread_usage(pid)).values():
        if cpu > 0 or sleeps > 0:
            c, n = by_name.get(name, (0.0, 0))
            by_name[name] = (c + cpu, n + sleeps)
    return sorted(((name, cpu / seconds * 1e3, n / seconds) for name, (cpu, n) in by_name.items()),
                  key=lambda r: (-r[1], -r[2], r[0]))


def main(argv: Sequence[str] | None = None) -> None:
    """Run it."""
    ap = argparse.ArgumentParser(prog="python -m bench.admin_cost", description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=300, help="requests of each path (default 300)")
    ap.add_argument("--idle-seconds", type=float, default=20.0,
                    help="how long each thread's idle CPU and wakes are read (default 20)")
    ap.add_argument("--profile", type=Path, help="also record the serve process with py-spy into this file")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="tw-admin-cost-"))
    mq = LocalRocketMQ(work / "mq")
    proc = None
    try:
        mq.start()
        mq.create_topics(["TW_DELAY_cost", "TW_DLQ_cost"], queues=8)
        port = free_port()
        proc = start_serve(work / "data", serve_env(mq, "cost"), work / "serve.log", port)
        base = f"http://127.0.0.1:{port}"
        for path, ms, size in measure(base, proc.pid, args.requests):
            print(f"{path:9} {ms:6.2f} ms of the engine's CPU a request ({size:,} bytes)")
        before = _cpu_s(proc.pid)
        rows = idle_threads(proc.pid, args.idle_seconds)
        print(f"idle      {(_cpu_s(proc.pid) - before) / args.idle_seconds * 1e3:6.1f} ms of CPU a second "
              "(in the figures above too), by thread:")
        for name, ms, wakes in rows:
            print(f"  {name:20} {ms:6.2f} ms a second, {wakes:6.1f} wakes a second")
        if args.profile is not None:
            spy = subprocess.Popen(["py-spy", "record", "-r", "1000", "-f", "raw", "-o", str(args.profile),
                                    "-p", str(proc.pid), "-d", "8"])
            end = time.monotonic() + 8
            while time.monotonic() < end:
                urllib.request.urlopen(base + "/metrics", timeout=5).read()
            spy.wait()
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
        mq.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
