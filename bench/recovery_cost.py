"""What the look-ups before sending again cost: the time to resolve the ambiguous set a crash leaves
after 1 s and 10 s of traffic at 1k/s and 10k/s, against a local RocketMQ of two brokers.

    python -m bench.recovery_cost [--rate 1000 --rate 10000] [--seconds 1 --seconds 10] [--sent 0.5] [--batch 256]

For each rate and duration: rate × seconds records for a target topic with queues on both brokers
are stored in a fresh data directory; a share of them (--sent) is delivered through the engine's
own sink (the copies a crash left unrecorded); then a fresh `BrokerCopyFinder` resolves every record
in send batches of --batch, as the dispatcher does after a restart: the first batch pays the
sentinel barrier on both brokers. Prints the wall time to resolve the whole set (the engine's
`dedupe_quiet_ms` comes on top) and µs per message; bench/RESULTS_LOOKUP.md holds the figures.
"""
from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

from forwarder.config import RocketMQConfig
from forwarder.copy_finder import BrokerCopyFinder
from forwarder.delivery import RocketMQSink
from forwarder.local_rocketmq import LocalRocketMQ
from forwarder.rocketmq import RemotingProducer
from storage import RecordBytes, ScheduleStore
from timewheel.message import Message


def _now() -> int:
    return int(time.time() * 1000)


def _records(data_dir: Path, topic: str, n: int, due: int) -> RecordBytes:
    """`n` stored records of 100-byte bodies due from `due`, read back as the dispatcher reads them."""
    with ScheduleStore(data_dir) as store:
        body = b"x" * 100
        loc = np.concatenate([store.append([Message(topic, body, due + i).to_record(uuid.uuid4().hex)
                                            for i in range(start, min(n, start + 5000))], _now()).locations
                              for start in range(0, n, 5000)])
        return store.read_record_bytes(loc["segment_ms"].astype(np.int64), loc["part"].astype(np.int64),
                                       loc["offset"].astype(np.int64), loc["due_ms"].astype(np.int64))


def measure(mq: LocalRocketMQ, n: int, sent_share: float, batch: int) -> dict[str, float]:
    """Resolve `n` records of which `sent_share` were delivered: wall seconds and what was found."""
    topic = f"RECOVERY_BENCH_{uuid.uuid4().hex[:8]}"
    mq.create_topics([topic])
    cfg = RocketMQConfig(namesrv=mq.namesrv_addr, producer_group=f"tw_recovery_bench_{topic}", send_threads=1)
    with tempfile.TemporaryDirectory(prefix="timewheel-recovery-") as d:
        t0 = _now()
        records = _records(Path(d), topic, n, t0)
        dead = RemotingProducer(cfg.namesrv, cfg.producer_group)
        sink = RocketMQSink(cfg, dead)
        sent_rows = np.flatnonzero(np.random.default_rng(1).random(n) < sent_share)
        for start in range(0, len(sent_rows), batch):
            assert all(sink.send_records(records.select(sent_rows[start:start + batch])))
        sink.close()
        dead.close()
        finder = BrokerCopyFinder(cfg, _now)
        found = unknown = 0
        started = time.perf_counter()
        written_before = _now()  # every copy of the crashed run was written before the look-ups began
        for start in range(0, n, batch):
            check = finder.find_copies(records.select(np.arange(start, min(n, start + batch))), t0 - 1000,
                                       written_before)
            found += int(check.found.sum())
            unknown += int(check.unknown.sum())
        took = time.perf_counter() - started
        finder.close()
    if found != len(sent_rows) or unknown:
        raise SystemExit(f"wrong answer: found {found} of {len(sent_rows)} sent, {unknown} unknown")
    return {"n": n, "sent": len(sent_rows), "found": found, "seconds": took, "us_per_message": took * 1e6 / n}


def main() -> None:
    """Run every rate × duration and print a table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=int, action="append", help="messages per second (repeatable; 1000 and 10000)")
    ap.add_argument("--seconds", type=int, action="append", help="seconds of traffic (repeatable; 1 and 10)")
    ap.add_argument("--sent", type=float, default=0.5, help="share already delivered before the crash")
    ap.add_argument("--batch", type=int, default=256, help="records per look-up call (the send batch)")
    args = ap.parse_args()
    rows = []
    with LocalRocketMQ(brokers=2, stop_timeout=3.0) as mq:
        for rate in args.rate or [1000, 10000]:
            for secs in args.seconds or [1, 10]:
                r = measure(mq, rate * secs, args.sent, args.batch)
                rows.append((rate, secs, r))
                print(f"{rate}/s x {secs} s: {r['n']:,} ambiguous, {r['found']:,} found: resolved in "
                      f"{r['seconds']:.2f} s ({r['us_per_message']:.0f} µs a message)", flush=True)
    print("\n| traffic | ambiguous | found (sent before the crash) | time to resolve | µs a message |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for rate, secs, r in rows:
        print(f"| {rate:,}/s × {secs} s | {r['n']:,} | {r['found']:,} | {r['seconds']:.2f} s | "
              f"{r['us_per_message']:.0f} |")


if __name__ == "__main__":
    main()
