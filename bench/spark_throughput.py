"""Backfill and audit throughput of the Spark jobs, in records a second.

    python -m bench.spark_throughput --records 10000000 --master 'local[2]'

Generates `records` input rows (Parquet, 100-byte bodies, 4 topics, due over `hours` hourly
segments, no msg_id so ids are derived from content), backfills them into a fresh data directory,
writes dispatch logs as the engine would have (97% delivered with a few ms of lateness, 1%
cancelled, 0.5% dead-lettered, the rest pending), then audits it:

- `audit_cli`: `timewheel audit --json` run as a user runs it, a process of its own; its wall time
  is everything the user waits for: Python start, the Spark session (JVM start), the scan, the
  report, the findings (Parquet) and the chart (PNG).
- `audit_session`: in another process, a session started as the CLI starts it (its start timed on
  its own), then `--audits` runs of `spark.audit.run_audit` in it: the first pays for starting the
  Python workers and compiling the plans, the later ones show a warm session.

Prints the figures and writes them, with the command and the machine's load (sampled every 5 s
throughout), to bench/spark_throughput.json. Wall time and CPU seconds (driver, JVM and Python
workers) are both reported: on a shared machine the CPU seconds say more than the wall clock.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import numpy as np

T0 = 1_800_000_000_000  # 2027-01-15T08:00:00Z
RESULTS = Path(__file__).with_name("spark_throughput.json")
ROOT = Path(__file__).resolve().parent.parent


class LoadSampler:
    """The 1-minute load average, sampled every `every` seconds in a thread."""

    def __init__(self, every: float = 5.0) -> None:
        self.every = every
        self.samples: list[float] = [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.samples.append(os.getloadavg()[0])

    def summary(self) -> dict[str, float]:
        """min, mean and max of the samples so far."""
        v = self.samples
        return {"min": round(min(v), 2), "mean": round(sum(v) / len(v), 2), "max": round(max(v), 2),
                "samples": len(v)}

    def phase(self, start: int) -> dict[str, float]:
        """min/mean/max of the samples taken since index `start`."""
        v = self.samples[start:] or self.samples[-1:]
        return {"min": round(min(v), 2), "mean": round(sum(v) / len(v), 2), "max": round(max(v), 2)}

    def stop(self) -> None:
        """Stop sampling."""
        self._stop.set()
        self._thread.join()


def tree_cpu_seconds() -> float:
    """User + system CPU seconds of this process and its descendants (reaped children included)."""
    kids: dict[int, list[list[str]]] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            st = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        rest = st[st.rindex(")") + 2:].split()
        kids.setdefault(int(rest[1]), []).append([pid, *rest])
    me = Path(f"/proc/{os.getpid()}/stat").read_text()
    total = sum(int(x) for x in me[me.rindex(")") + 2:].split()[11:15])
    stack = [os.getpid()]
    while stack:
        for row in kids.get(stack.pop(), []):
            total += sum(int(x) for x in row[12:16])
            stack.append(int(row[0]))
    return total / os.sysconf("SC_CLK_TCK")


def make_input(path: Path, n: int, hours: int, seed: int = 7) -> None:
    """n rows of Parquet input in files of a million rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    path.mkdir(parents=True)
    chunk = 1_000_000
    for c in range(0, n, chunk):
        m = min(chunk, n - c)
        body = rng.integers(0, 256, m * 100, dtype=np.uint8)
        offs = np.arange(0, (m + 1) * 100, 100, dtype=np.int32)
        tbl = pa.table({
            "topic": pa.array(np.array(["ORDERS", "PAYMENTS", "SHIPPING", "EMAIL"])[rng.integers(0, 4, m)]),
            "body": pa.Array.from_buffers(pa.binary(), m, [None, pa.py_buffer(offs), pa.py_buffer(body)]),
            "deliver_at_ms": pa.array(T0 + rng.integers(0, hours * 3_600_000, m)),
            "tags": pa.array(np.where(rng.random(m) < 0.5, "tagA", "tagB")),
        })
        pq.write_table(tbl, path / f"part-{c // chunk:04d}.parquet")


def write_dispatch_logs(data_dir: Path, seed: int = 3) -> int:
    """Dispatch logs as the engine would have written them; returns the entries written."""
    from storage import CANCELLED, DEAD_LETTERED, DELIVERED, SegmentLayout, dispatch_entries, encode_frame, read_index

    layout = SegmentLayout.open_existing(data_dir)
    rng = np.random.default_rng(seed)
    n = 0
    for seg in layout.list_segments():
        frames = []
        for part in layout.list_parts(seg):
            idx = read_index(layout.part_index(seg, part))
            u = rng.random(len(idx))
            for outcome, sel in ((DELIVERED, u < 0.97), (CANCELLED, (u >= 0.97) & (u < 0.98)),
                                 (DEAD_LETTERED, (u >= 0.98) & (u < 0.985))):
                e = idx[sel]
                late = rng.lognormal(1.5, 1.0, len(e)).astype(np.int64)
                at = e["due_ms"] + late if outcome != CANCELLED else e["due_ms"] - 60_000
                entries = dispatch_entries(part, e["offset"], e["due_ms"], at, outcome, 1)
                for s in range(0, len(entries), 100_000):
                    frames.append(encode_frame(entries[s:s + 100_000], seg))
                n += len(entries)
        with open(layout.dispatch_log(seg), "ab") as f:
            f.write(b"".join(frames))
    return n


def audit_session(data: Path, master: str, now_ms: int, runs: int, out_dir: Path, driver_memory: str) -> dict:
    """A session started as `timewheel audit` starts it, then `runs` audits in it (run in a
    process of its own, so that its JVM is started with the audit's options)."""
    from spark.audit import run_audit
    from spark.session import get_session

    cpu, t = tree_cpu_seconds(), time.time()
    spark = get_session(master, "timewheel-bench-audit", {"spark.ui.enabled": "false",
                                                          "spark.driver.memory": driver_memory}, light_jvm=True)
    spark.sparkContext.setLogLevel("ERROR")
    out: dict = {"session_start": {"wall_s": round(time.time() - t, 1), "cpu_s": round(tree_cpu_seconds() - cpu, 1)},
                 "runs": []}
    for _ in range(runs):
        cpu, t = tree_cpu_seconds(), time.time()
        rep = run_audit(spark, data, now_ms=now_ms, out_dir=out_dir)
        wall = time.time() - t
        out["runs"].append({"scheduled": rep.scheduled, "lost": rep.lost, "wall_s": round(wall, 1),
                            "cpu_s": round(tree_cpu_seconds() - cpu, 1), "records_per_s": round(rep.scheduled / wall),
                            "lateness_ms": rep.lateness_ms})
    spark.stop()
    return out


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns the figures."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=10_000_000)
    p.add_argument("--hours", type=int, default=24, help="segments the due times spread over")
    p.add_argument("--master", default="local[2]")
    p.add_argument("--audits", type=int, default=2, help="audit runs in one session (the first one starts the workers)")
    p.add_argument("--driver-memory", default="4g")
    p.add_argument("--workdir", type=Path, default=None, help="where the data goes (default: a temporary dir)")
    p.add_argument("--no-save", action="store_true", help="do not write bench/spark_throughput.json")
    p.add_argument("--audit-session", type=Path, default=None, help=argparse.SUPPRESS)  # the child process's mode
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message="PySpark does not yet fully support pandas", category=FutureWarning)
    now_ms = T0 + (args.hours + 1) * 3_600_000
    if args.audit_session is not None:
        figures = audit_session(args.audit_session / "data", args.master, now_ms, args.audits,
                                args.audit_session / "audit-session", args.driver_memory)
        print("RESULT " + json.dumps(figures), flush=True)
        return figures
    from spark.backfill import backfill, read_input
    from spark.session import get_session
    from storage import SegmentLayout

    work = Path(tempfile.mkdtemp(prefix="tw-spark-bench-", dir=args.workdir))
    load = LoadSampler()
    out: dict = {"command": "python -m bench.spark_throughput " + " ".join(argv if argv is not None else sys.argv[1:]),
                 "records": args.records, "segments": args.hours, "master": args.master,
                 "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                             "load_before": os.getloadavg()}}
    try:
        t = time.time()
        make_input(work / "input", args.records, args.hours)
        print(f"input: {args.records:,} rows in {time.time() - t:.1f} s", flush=True)
        spark = get_session(args.master, "timewheel-bench", {"spark.ui.enabled": "false",
                                                             "spark.driver.memory": args.driver_memory})
        spark.sparkContext.setLogLevel("ERROR")
        data = work / "data"
        SegmentLayout(data)
        mark, cpu, t = len(load.samples), tree_cpu_seconds(), time.time()
        res = backfill(spark, data, read_input(spark, [str(work / "input")]), now_ms=T0)
        wall = time.time() - t
        out["backfill"] = {"scheduled": res.scheduled, "parts": len(res.parts), "wall_s": round(wall, 1),
                           "cpu_s": round(tree_cpu_seconds() - cpu, 1),
                           "records_per_s": round(res.scheduled / wall), "load_1min": load.phase(mark)}
        print(f"backfill: {res.scheduled:,} records in {wall:.1f} s = {res.scheduled / wall:,.0f} records/s "
              f"({out['backfill']['cpu_s']} CPU s)", flush=True)
        spark.stop()
        out["dispatch_entries"] = write_dispatch_logs(data)

        # as a user runs it: one process, everything included
        mark, t = len(load.samples), time.time()
        cli = subprocess.run([sys.executable, "-m", "timewheel", "audit", "--data-dir", str(data), "--master",
                              args.master, "--now", str(now_ms), "--json", "--out", str(work / "audit-cli")],
                             cwd=ROOT, capture_output=True, text=True)
        wall = time.time() - t
        rep = json.loads(cli.stdout.strip().splitlines()[-1])
        out["audit_cli"] = {"command": f"timewheel audit --data-dir DIR --master {args.master} --now {now_ms} "
                                       "--json --out OUT", "includes": "python start, JVM and Spark session start, "
                            "scan, report, findings Parquet, PNG chart, session stop",
                            "exit_code": cli.returncode, "scheduled": rep["scheduled"], "lost": rep["lost"],
                            "wall_s": round(wall, 1), "records_per_s": round(rep["scheduled"] / wall),
                            "load_1min": load.phase(mark)}
        print(f"audit (CLI, end to end): {rep['scheduled']:,} records in {wall:.1f} s", flush=True)

        mark = len(load.samples)
        child = subprocess.run([sys.executable, "-m", "bench.spark_throughput", "--audit-session", str(work),
                                "--master", args.master, "--hours", str(args.hours), "--audits", str(args.audits),
                                "--driver-memory", args.driver_memory], cwd=ROOT, capture_output=True, text=True)
        line = [ln for ln in child.stdout.splitlines() if ln.startswith("RESULT ")]
        if not line:
            raise RuntimeError(f"audit session failed: {child.stderr[-3000:]}")
        sess = json.loads(line[-1][len("RESULT "):])
        sess["includes"] = ("session_start: JVM and Spark session start; runs: spark.audit.run_audit only "
                            "(scan, report, findings Parquet, PNG chart)")
        sess["load_1min"] = load.phase(mark)
        out["audit_session"] = sess
        print(f"session start: {sess['session_start']['wall_s']} s", flush=True)
        for run in sess["runs"]:
            print(f"audit (in session): {run['scheduled']:,} records in {run['wall_s']} s = "
                  f"{run['records_per_s']:,} records/s ({run['cpu_s']} CPU s)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load.stop()
    out["machine"]["load_after"] = os.getloadavg()
    out["machine"]["load_1min_during_run"] = load.summary()
    if not args.no_save:
        RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
