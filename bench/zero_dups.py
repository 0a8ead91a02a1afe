"""The zero-duplicates fault harness's long form (tests/forwarder/dedupe_harness.py): a RocketMQ of
two brokers and a ZooKeeper of its own, `--rounds` faults of every kind in turn, then the table of
rounds and a JSON document.

    python -m bench.zero_dups --rounds 50 [--dedupe off] [--index-unsafe] [--faults broker_kill,...]
                              [--rate 40] [--seed 0] [--json PATH]

`--dedupe off` runs the engines without the look-up before re-sending (a negative control: it must
show duplicates). `--index-unsafe` starts the brokers with messageIndexSafe=false (whose index loses
its latest entries on a kill -9) and, unless `--faults` says otherwise, runs broker_kill rounds
only (the other negative control). Exits 1 if the checker found anything: lost messages,
duplicates, a deposed holder's late copy, or no look-up that found a copy or led to a re-send.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from coordination import LocalZooKeeper
from forwarder.local_rocketmq import LocalRocketMQ
from tests.forwarder.dedupe_harness import BROKER_OPTIONS, CHECKPOINTED_S, FAULTS, report_json, rounds_of, run


def main(argv: list[str] | None = None) -> int:
    """Run the rounds, print the table and the totals, write the JSON; 1 on any failure."""
    p = argparse.ArgumentParser(prog="python -m bench.zero_dups", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=len(FAULTS))
    p.add_argument("--faults", default="", help=f"comma-separated, of {', '.join(FAULTS)} (default: each in turn)")
    p.add_argument("--dedupe", choices=("on", "off"), default="on")
    p.add_argument("--index-unsafe", action="store_true", help="brokers with messageIndexSafe=false")
    p.add_argument("--checkpoint-wait", type=float, default=None,
                   help=f"seconds a broker fault waits after rolling the broker's log, a trickle of messages going "
                        f"on (default 5; {CHECKPOINTED_S:g} with --index-unsafe: past the broker's checkpoint write, "
                        f"every 60 s, so that its crash recovery starts after the copies in question)")
    p.add_argument("--rate", type=float, default=40.0, help="messages a second of each of the two producers")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="where to write the report (default: print the path "
                                                            "of one in a temporary directory)")
    args = p.parse_args(argv)
    if args.faults:
        kinds = args.faults.split(",")
        faults = [kinds[i % len(kinds)] for i in range(args.rounds)]
    else:
        faults = ["broker_kill"] * args.rounds if args.index_unsafe else rounds_of(args.rounds)
    unknown = set(faults) - set(FAULTS)
    if unknown:
        p.error(f"unknown faults {sorted(unknown)}")
    wait = args.checkpoint_wait if args.checkpoint_wait is not None else (CHECKPOINTED_S if args.index_unsafe else 5.0)
    started, load = time.monotonic(), os.getloadavg()
    options = {**BROKER_OPTIONS, **({"messageIndexSafe": False} if args.index_unsafe else {})}
    with tempfile.TemporaryDirectory(prefix="zero-dups-") as tmp:
        work = Path(tmp)
        with LocalRocketMQ(work / "mq", brokers=2, stop_timeout=3.0, broker_options=options) as mq, \
                LocalZooKeeper() as zk:
            report = run(mq, zk, work / "engines", faults, dedupe=args.dedupe == "on", rate=args.rate,
                         seed=args.seed, log=lambda s: print(s, flush=True), checkpoint_wait_s=wait)
        seconds = time.monotonic() - started
        doc = report_json(report, rounds=len(faults), faults=faults, dedupe=args.dedupe,
                          index_safe=not args.index_unsafe, checkpoint_wait_s=wait, rate=args.rate, seed=args.seed, seconds=round(seconds),
                          load_at_start=round(load[0], 2), load_at_end=round(os.getloadavg()[0], 2))
        out = args.json or Path(tempfile.mkdtemp(prefix="zero-dups-report-")) / "zero_dups.json"
        out.write_text(json.dumps(doc, indent=1) + "\n")
    print()
    print(report.table())
    print()
    print(json.dumps(report.totals))
    print(f"{len(faults)} rounds, dedupe {args.dedupe}, messageIndexSafe={str(not args.index_unsafe).lower()}, "
          f"{args.rate:g} messages/s per producer, {seconds:.0f} s; load average at start {load[0]:.2f}, "
          f"at end {os.getloadavg()[0]:.2f}; report in {out}")
    for f in report.failures:
        print("FAILED:", f)
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
