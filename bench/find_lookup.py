"""Where is my message, at scale: `timewheel find` look-ups by id and by key over a large data directory.

    python -m bench.find_lookup [--messages 10000000] [--segments 24] [--lookups 1000] [--cold N] [--data-dir D]

Builds (or reuses, with --data-dir) a data directory of --messages stored messages over
--segments hourly segments, as the engine stores them (`ScheduleStore.append`, in batches of 50 000;
ids `<UNIQ_KEY>:<crc>` as ingest makes them, 16-byte bodies), two messages per business key (one
in the first half of the hours, one in the second, so a key look-up reads two segments' dispatch
logs), and the first half of the segments delivered (TWD3 dispatch frames of 128 with the broker's
answers, as the engine writes them). Then, with the store closed (as beside a stopped engine; the
meta store opened read-only, the ingest log searched as `timewheel find` does), times
`MessageFinder.by_id` with the producer's id (a prefix seek) and `MessageFinder.by_key`, each on
--lookups random messages: p50, p90, p99, max in ms, the first pass (files cold unless the page
cache kept them) and a second pass over the same messages (warm). With --cold N, N more look-ups
each way as a fresh `timewheel find` process meets them: the data directory's files dropped from
the page cache first (`posix_fadvise(DONTNEED)` on its files only) and the meta store opened anew
(the open timed apart from the look-up). Writes
bench/results/find_lookup.json; bench/RESULTS_FIND.md holds the figures of record.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from bench.engine_latency import _machine
from storage import ANSWER_DTYPE, DELIVERED, Record, ScheduleStore, dispatch_entries
from storage.audit import data_dir_bytes
from timewheel.find import MessageFinder

HOUR = 3_600_000
T0 = 1_800_000_000_000  # on an hour boundary
BATCH = 50_000


def uniq(i: int) -> str:
    """The producer's id (UNIQ_KEY) of message i."""
    return f"{0xC0A80001:08X}{i:024X}"


def build(data_dir: Path, messages: int, segments: int) -> dict[str, float]:
    """Store `messages` over `segments` hours, two per key, and deliver the first half of the hours."""
    t = time.perf_counter()
    half = messages // 2
    with ScheduleStore(data_dir, flush="async") as store:
        for start in range(0, messages, BATCH):
            n = min(BATCH, messages - start)
            idx = np.arange(start, start + n)
            due = T0 + (idx * segments // messages) * HOUR + idx % HOUR
            store.append([Record(f"{uniq(i)}:{i & 0xFFFFFFFF:08x}", "ORDERS", b"0123456789abcdef", int(d),
                                 keys=(f"order-{i % half}",), tags="t") for i, d in zip(idx.tolist(), due.tolist())],
                         T0 - HOUR)
        stored_s = time.perf_counter() - t
        store.seal_live_parts(T0 + segments * HOUR)
        for seg in store.layout.list_segments()[: segments // 2]:
            ix = store.segment_index(seg)
            for s in range(0, len(ix), 128):
                e = slice(s, s + 128)
                n = len(ix.offset[e])
                answers = np.zeros(n, ANSWER_DTYPE)
                answers["queue_offset"] = np.arange(s, s + n)
                answers["commit_offset"] = np.arange(s, s + n) * 180
                answers["store_ip"] = [127, 0, 0, 1]
                answers["store_port"] = 10911
                store.record_dispatch(seg, dispatch_entries(ix.part[e], ix.offset[e], ix.due_ms[e], seg + HOUR,
                                                             DELIVERED), seg + HOUR, answers)
        store.checkpoint()
    return {"store_seconds": round(stored_s, 1), "build_seconds": round(time.perf_counter() - t, 1)}


def timed(fn: Callable[[int], object], picks: Sequence[int]) -> dict[str, float]:
    """Latency figures (ms) of fn over picks."""
    ms = []
    for i in picks:
        t = time.perf_counter()
        fn(i)
        ms.append((time.perf_counter() - t) * 1000)
    return _figures(ms)


def evict(data_dir: Path) -> None:
    """Drop the data directory's files from the page cache (theirs only: other processes' pages stay)."""
    for path in data_dir.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def cold(data_dir: Path, picks: Sequence[int], half: int) -> dict[str, object]:
    """Each look-up as a fresh `timewheel find` process meets it: the data directory's pages evicted,
    the meta store opened anew (its open timed apart); by id then by key."""
    opens: list[float] = []
    by_id: list[float] = []
    by_key: list[float] = []
    for i in picks:
        for how, times in (("id", by_id), ("key", by_key)):
            evict(data_dir)
            t = time.perf_counter()
            finder = MessageFinder.beside_engine(data_dir)
            opens.append((time.perf_counter() - t) * 1000)
            try:
                t = time.perf_counter()
                found = finder.by_id(uniq(i), T0) if how == "id" else finder.by_key(f"order-{i % half}", T0)
                times.append((time.perf_counter() - t) * 1000)
                assert found.trails, found.to_dict()
            finally:
                finder.close()
    return {"by_id": _figures(by_id), "by_key": _figures(by_key), "open_meta_store": _figures(opens)}


def _figures(ms: list[float]) -> dict[str, float]:
    a = np.asarray(ms)
    return {"p50_ms": round(float(np.percentile(a, 50)), 2), "p90_ms": round(float(np.percentile(a, 90)), 2),
            "p99_ms": round(float(np.percentile(a, 99)), 2), "max_ms": round(float(a.max()), 2), "n": len(ms)}


def run(data_dir: Path, messages: int, segments: int, lookups: int, seed: int,
        cold_lookups: int = 0) -> dict[str, object]:
    """Build if needed, then time the look-ups."""
    built: dict[str, float] = {}
    if not (data_dir / "timewheel.json").exists():
        built = build(data_dir, messages, segments)
    rng = random.Random(seed)
    picks = [rng.randrange(messages) for _ in range(lookups)]
    half = messages // 2
    out: dict[str, object] = {"machine": _machine(), "messages": messages, "segments": segments, **built,
                              "data_dir_bytes": data_dir_bytes(data_dir)}
    with MessageFinder.beside_engine(data_dir) as finder:
        def by_id(i: int) -> None:
            found = finder.by_id(uniq(i), T0)
            assert len(found.trails) == 1 and found.trails[0].record is not None, found.to_dict()

        def by_key(i: int) -> None:
            found = finder.by_key(f"order-{i % half}", T0)
            assert len(found.trails) == 2, found.to_dict()
            assert found.trails[0].state == "delivered" and found.trails[1].state == "pending"

        for name, fn in (("by_id", by_id), ("by_key", by_key)):
            out[name] = {"first_pass": timed(fn, picks), "second_pass": timed(fn, picks)}
    if cold_lookups:
        out["cold"] = cold(data_dir, picks[:cold_lookups], half)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    """Parse arguments, run, print and save the figures."""
    ap = argparse.ArgumentParser(prog="python -m bench.find_lookup", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=10_000_000)
    ap.add_argument("--segments", type=int, default=24)
    ap.add_argument("--lookups", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=26)
    ap.add_argument("--cold", type=int, default=0, metavar="N",
                    help="also N look-ups each way from a cold page cache and a freshly opened meta store")
    ap.add_argument("--data-dir", type=Path, help="build here (or reuse what is here); default a temporary one")
    ap.add_argument("--out", type=Path, default=Path("bench/results/find_lookup.json"))
    args = ap.parse_args(argv)
    if args.data_dir is not None:
        result = run(args.data_dir, args.messages, args.segments, args.lookups, args.seed, args.cold)
    else:
        with tempfile.TemporaryDirectory(prefix="tw-find-bench-") as d:
            result = run(Path(d), args.messages, args.segments, args.lookups, args.seed, args.cold)
    text = json.dumps(result, indent=2)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
