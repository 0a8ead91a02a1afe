"""End-to-end engine harness with the real clock and an in-process sink.

    python -m bench.engine_latency lateness --rate 10000 --rate 50000 --seconds 10
    python -m bench.engine_latency restart --messages 10000000 --segments 48

`lateness` schedules `rate * seconds` messages due evenly over `seconds`, then records, for each,
the time the sink received it minus its due time. `restart` fills a store with messages over
`segments` hourly segments, closes it, and times a new engine from `start()` to its first send.
Results are printed and written as JSON under bench/results/.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

import numpy as np

from storage import Record, ScheduleStore
from timewheel import Engine, EngineConfig, Message, SystemClock

RESULTS = Path(__file__).parent / "results"


class TimingSink:
    """Records, per message, the wall time it reached the sink, in numpy chunks."""

    def __init__(self) -> None:
        self.sent_ns: list[np.ndarray] = []
        self.due_ms: list[np.ndarray] = []
        self.count = 0
        self.first_send_ns: int | None = None
        self.lock = threading.Lock()

    def send_batch(self, messages: Sequence[Message]) -> list[bool]:
        now = time.time_ns()
        with self.lock:
            if self.first_send_ns is None:
                self.first_send_ns = now
            self.sent_ns.append(np.full(len(messages), now, np.int64))
            self.due_ms.append(np.fromiter((m.deliver_at_ms for m in messages), np.int64, len(messages)))
            self.count += len(messages)
        return [True] * len(messages)

    def lateness_ms(self) -> np.ndarray:
        return np.concatenate(self.sent_ns) / 1e6 - np.concatenate(self.due_ms)


def _percentiles(late: np.ndarray) -> dict[str, float]:
    p = np.percentile(late, [50, 99, 99.9])
    return {"p50": round(float(p[0]), 3), "p99": round(float(p[1]), 3), "p999": round(float(p[2]), 3),
            "max": round(float(late.max()), 3), "min": round(float(late.min()), 3)}


def run_lateness(rate: int, seconds: float, data_root: Path) -> dict[str, object]:
    """Schedule rate*seconds messages due evenly over `seconds`; measure send time minus due."""
    n = int(rate * seconds)
    sink = TimingSink()
    data_dir = Path(tempfile.mkdtemp(dir=data_root))
    engine = Engine(EngineConfig(data_dir, send_batch_size=512), sink).start()
    try:
        clock = SystemClock()
        lead_ms = 3000 + n // 20  # time to schedule everything (at 20k/s, a loaded machine) before the first is due
        start = clock.now_ms() + lead_ms
        dues = start + (np.arange(n) * 1000 // rate)
        t0 = time.perf_counter()
        for chunk in np.array_split(dues, max(1, n // 5000)):
            engine.schedule([Message("BENCH", b"x" * 200, d) for d in chunk.tolist()])
        ingest_s = time.perf_counter() - t0
        peak_entries, peak_bytes = 0, 0
        deadline = time.monotonic() + lead_ms / 1000 + seconds + 30
        while sink.count < n and time.monotonic() < deadline:
            st = engine.stats()
            if st.wheel_entries > peak_entries:
                peak_entries, peak_bytes = st.wheel_entries, st.wheel_bytes
            time.sleep(0.05)
        late = sink.lateness_ms()
    finally:
        engine.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
    return {"rate": rate, "messages": n, "delivered": int(len(late)), "ingest_per_s": round(n / ingest_s),
            "lateness_ms": _percentiles(late),
            "wheel_bytes_per_entry": round(peak_bytes / peak_entries, 2) if peak_entries else None}


def run_restart(messages: int, segments: int, data_root: Path) -> dict[str, object]:
    """Fill `segments` hourly segments with `messages`, then time start() to the first send."""
    data_dir = Path(tempfile.mkdtemp(dir=data_root))
    clock = SystemClock()
    now = clock.now_ms()
    hour = 3_600_000
    first_hour = now - now % hour
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    store = ScheduleStore(data_dir)
    batch = 20_000
    overdue = 1000  # due a second before the restart: the first send proves the engine is serving
    for start in range(0, messages, batch):
        k = min(batch, messages - start)
        dues = (first_hour + rng.integers(0, segments * hour, k)).tolist()
        if start == 0:
            dues[:overdue] = [now - 1000] * overdue
        store.append([Record(f"m{start + i}", "BENCH", b"0123456789abcdef", d) for i, d in enumerate(dues)], now)
    store.close()
    fill_s = time.perf_counter() - t0
    disk = sum(f.stat().st_size for f in data_dir.rglob("*") if f.is_file())
    sink = TimingSink()
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t_start = time.time_ns()
    engine = Engine(EngineConfig(data_dir), sink).start()
    started_ns = time.time_ns()
    while sink.first_send_ns is None and time.time_ns() - t_start < 120e9:
        time.sleep(0.001)
    first_ns = sink.first_send_ns or time.time_ns()
    time.sleep(1.0)
    st = engine.stats()
    engine.stop()
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    shutil.rmtree(data_dir, ignore_errors=True)
    return {"messages": messages, "segments": segments, "fill_s": round(fill_s, 1), "disk_bytes": disk,
            "start_call_ms": round((started_ns - t_start) / 1e6, 1),
            "restart_to_first_dispatch_ms": round((first_ns - t_start) / 1e6, 1),
            "wheel_entries": st.wheel_entries, "wheel_bytes": st.wheel_bytes,
            "max_rss_growth_mb": round((rss1 - rss0) / 1024, 1)}


def _machine() -> dict[str, object]:
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()]}


def main(argv: Sequence[str] | None = None) -> None:
    """Parse arguments and run the chosen harness."""
    ap = argparse.ArgumentParser(prog="python -m bench.engine_latency", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    la = sub.add_parser("lateness", help="lateness at steady due rates")
    la.add_argument("--rate", type=int, action="append", help="due messages per second (repeatable)")
    la.add_argument("--seconds", type=float, default=10.0)
    re = sub.add_parser("restart", help="restart-to-first-dispatch over a large backlog")
    re.add_argument("--messages", type=int, default=10_000_000)
    re.add_argument("--segments", type=int, default=48)
    for p in (la, re):
        p.add_argument("--out", type=Path, default=None,
                       help="write the JSON here instead of bench/results/ (a trial run, not the committed figures)")
    ap.add_argument("--data-root", type=Path, default=None, help="where temporary data directories go")
    args = ap.parse_args(argv)
    root = args.data_root or Path(tempfile.gettempdir())
    RESULTS.mkdir(exist_ok=True)
    if args.cmd == "lateness":
        rows = [run_lateness(r, args.seconds, root) for r in (args.rate or [10_000, 50_000])]
        out = {"machine": _machine(), "command": "python -m bench.engine_latency lateness " +
               " ".join(f"--rate {r['rate']}" for r in rows) + f" --seconds {args.seconds:g}", "runs": rows}
        for r in rows:
            print(f"rate {r['rate']:>6}/s  delivered {r['delivered']:>7}/{r['messages']:<7} lateness ms "
                  f"{r['lateness_ms']}  ingest {r['ingest_per_s']}/s  wheel B/entry {r['wheel_bytes_per_entry']}")
        (args.out or RESULTS / "engine_lateness.json").write_text(json.dumps(out, indent=2) + "\n")
    else:
        r = run_restart(args.messages, args.segments, root)
        out = {"machine": _machine(), "command": f"python -m bench.engine_latency restart --messages "
               f"{args.messages} --segments {args.segments}", "run": r}
        print(json.dumps(r, indent=2))
        (args.out or RESULTS / "engine_restart.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
