"""Backfill and audit throughput of the Spark jobs, in records a second.

    python -m bench.spark_throughput --records 10000000 --master 'local[2]'

Generates `records` input rows (Parquet, 100-byte bodies, 4 topics, due over `hours` hourly
segments, no msg_id so ids are derived from content), backfills them into a fresh data directory,
writes dispatch logs as the engine would have (97% delivered with a few ms of lateness, 1%
cancelled, 0.5% dead-lettered, the rest pending), then audits it `--audits` times. Prints the
figures and writes them, with the command and the machine's load, to bench/spark_throughput.json.
Wall time and CPU seconds (driver, JVM and Python workers) are both reported: on a shared machine
the CPU seconds say more than the wall clock.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

T0 = 1_800_000_000_000  # 2027-01-15T08:00:00Z
RESULTS = Path(__file__).with_name("spark_throughput.json")


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


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; returns the figures."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--records", type=int, default=10_000_000)
    p.add_argument("--hours", type=int, default=24, help="segments the due times spread over")
    p.add_argument("--master", default="local[2]")
    p.add_argument("--audits", type=int, default=2, help="audit runs (the first one warms the workers up)")
    p.add_argument("--driver-memory", default="4g")
    p.add_argument("--workdir", type=Path, default=None, help="where the data goes (default: a temporary dir)")
    p.add_argument("--no-save", action="store_true", help="do not write bench/spark_throughput.json")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore", message="PySpark does not yet fully support pandas", category=FutureWarning)
    from spark.audit import run_audit
    from spark.backfill import backfill, read_input
    from spark.session import get_session
    from storage import SegmentLayout

    work = Path(tempfile.mkdtemp(prefix="tw-spark-bench-", dir=args.workdir))
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
        cpu, t = tree_cpu_seconds(), time.time()
        res = backfill(spark, data, read_input(spark, [str(work / "input")]), now_ms=T0)
        wall = time.time() - t
        out["backfill"] = {"scheduled": res.scheduled, "parts": len(res.parts), "wall_s": round(wall, 1),
                           "cpu_s": round(tree_cpu_seconds() - cpu, 1),
                           "records_per_s": round(res.scheduled / wall)}
        print(f"backfill: {res.scheduled:,} records in {wall:.1f} s = {res.scheduled / wall:,.0f} records/s "
              f"({out['backfill']['cpu_s']} CPU s)", flush=True)
        out["dispatch_entries"] = write_dispatch_logs(data)
        out["audits"] = []
        for _ in range(args.audits):
            cpu, t = tree_cpu_seconds(), time.time()
            rep = run_audit(spark, data, now_ms=T0 + (args.hours + 1) * 3_600_000, out_dir=work / "audit")
            wall = time.time() - t
            run = {"scheduled": rep.scheduled, "lost": rep.lost, "wall_s": round(wall, 1),
                   "cpu_s": round(tree_cpu_seconds() - cpu, 1), "records_per_s": round(rep.scheduled / wall),
                   "lateness_ms": rep.lateness_ms}
            out["audits"].append(run)
            print(f"audit: {rep.scheduled:,} records in {wall:.1f} s = {rep.scheduled / wall:,.0f} records/s "
                  f"({run['cpu_s']} CPU s)", flush=True)
        spark.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out["machine"]["load_after"] = os.getloadavg()
    if not args.no_save:
        RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
