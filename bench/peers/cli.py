"""`python -m bench.peers run|report|ab`: parse arguments, call the runner, the report or the A/B runs."""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any, cast

from bench.peers.common import RESULTS_DIR
from bench.peers.report import console, write_report
from bench.peers.runner import ALL_SYSTEMS, RunConfig, run_fast_switch

_HELP = {
    "steady_rate": "steady workload: messages per second",
    "steady_seconds": "steady workload: seconds of producing",
    "steady_high_rate": "high-rate steady workload (plain hop and timewheel): messages per second",
    "steady_high_seconds": "high-rate steady workload: seconds of producing",
    "steady_high_warm_up_s": "high-rate steady workload: seconds of the same stream before it, not measured "
                             "(the Java clients' JVMs warm up)",
    "delay_min_ms": "steady workload: shortest delay (ms)",
    "delay_max_ms": "steady workload: longest delay (ms)",
    "burst": "burst workload: messages due in the same millisecond",
    "burst_lead_s": "burst workload: how far ahead of the due time sending starts (s)",
    "horizon_messages": "horizon workload: pending messages",
    "horizon_broker_messages": "horizon workload: pending messages for RocketMQ's timer and levels (sent one by one)",
    "horizon_days": "horizon workload: span of the due times (days)",
    "probes": "restart: messages due while the system is down",
    "body_bytes": "message body size",
    "senders": "producer threads",
    "poll_ms": "Redis and PostgreSQL pollers: longest sleep between polls (ms)",
    "intake_seconds": ("intake ceiling, the no-op consumer's backlog and timewheel's batch ingest: seconds of "
                       "RocketMQ's Java producer"),
    "intake_threads": "intake ceiling and batch ingest: Java producer threads",
    "intake_batch": "intake ceiling and batch ingest: messages per batch send",
    "pull_batch": "no-op consumer: messages per pull (timewheel's own consumer pulls 32)",
    "stages": "timewheel only: run the engine under `python -m bench.stage_cpu serve`, its stages' CPU "
              "written to this file (read it with `python -m bench.stage_cpu timeline`); empty: not",
    "broker_logs": ("a directory: each local RocketMQ's logs (its store.log holds the broker's own put latency "
                    "each minute, [PAGECACHERT]) are copied to DIR/SYSTEM before its store goes; empty: not"),
    "engine_tree": ("timewheel only: run `timewheel serve` from this directory, a checkout of another revision "
                    "(its engine under this harness; `bench.peers ab --engine-only` makes one); empty: this checkout"),
    "seed": "random seed of the delays and due times",
    "broker_per_system": "start a fresh local RocketMQ for each system and reference row, so that what one "
                         "leaves in the broker (the intake rows store millions) does not move the next one's "
                         "figures; --no-broker-per-system: one broker for the whole run",
}


def _require_bench_extras(systems: Sequence[str]) -> None:
    """Exit naming the install command if a module `systems` need is missing: each system would
    otherwise fail on its first import, one after another, each after starting its broker."""
    import importlib.util

    needed = ["psutil"] + ["redis"] * ("redis-zset" in systems) + ["psycopg"] * ("postgres" in systems)
    if missing := [m for m in needed if importlib.util.find_spec(m) is None]:
        sys.exit(f"the benchmark needs {', '.join(missing)}: pip install -e '.[dev,bench]' "
                 "(`make bench-peers` installs them and runs it)")


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["ab"]:  # its own flags: `python -m bench.peers ab --help`
        from bench.peers.ab import main as ab_main

        ab_main(args_list[1:])
        return
    ap = argparse.ArgumentParser(prog="python -m bench.peers",
                                 description="Latency benchmarks of timewheel and its peers, side by side.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the workloads against the systems, write results and RESULTS.md")
    r.add_argument("--system", action="append", choices=ALL_SYSTEMS, dest="systems",
                   help="run only this system or reference row (repeatable; default all)")
    defaults = RunConfig()
    for f in fields(RunConfig):
        if f.name == "systems":
            continue
        if isinstance(getattr(defaults, f.name), bool):
            r.add_argument("--" + f.name.replace("_", "-"), action=argparse.BooleanOptionalAction,
                           default=getattr(defaults, f.name), help=f"{_HELP[f.name]} (default %(default)s)")
            continue
        r.add_argument("--" + f.name.replace("_", "-"), type=type(getattr(defaults, f.name)),
                       default=getattr(defaults, f.name), help=f"{_HELP[f.name]} (default %(default)s)")
    r.add_argument("--stem", default="peers", help="results file names: bench/results/STEM.json/.png")
    r.add_argument("--no-results-md", action="store_true",
                   help="write only the JSON and the chart, leave bench/RESULTS.md alone (trial runs)")
    sub.add_parser("ab", help="the targets' rows for another revision and this checkout, in alternating runs "
                              "(`python -m bench.peers ab --help`)")
    rep = sub.add_parser("report", help="rebuild RESULTS.md and the chart from a results JSON")
    rep.add_argument("--stem", default="peers")
    for p in (r, rep):
        p.add_argument("--out", type=Path, default=None,
                       help="a scratch directory for trial runs: OUT/RESULTS.md, OUT/results/STEM.json and .png, "
                            "leaving bench/ alone")
    args = ap.parse_args(args_list)
    if args.cmd == "run":
        cfg = RunConfig(**{f.name: getattr(args, f.name) for f in fields(RunConfig) if f.name != "systems"},
                        systems=tuple(args.systems or ALL_SYSTEMS))
        _require_bench_extras(cfg.systems)
        command = "python -m bench.peers " + shlex.join(args_list)
        doc = run_fast_switch(cfg, command)
        if args.out is not None:
            write_report(doc, args.stem, args.out)
        elif args.no_results_md:
            from bench.peers.report import chart

            RESULTS_DIR.mkdir(parents=True, exist_ok=True)
            (RESULTS_DIR / f"{args.stem}.json").write_text(json.dumps(doc, indent=1) + "\n")
            chart(doc, RESULTS_DIR / f"{args.stem}.png")
        else:
            write_report(doc, args.stem)
        print(console(doc))
        systems = cast("dict[str, dict[str, Any]]", doc["systems"])
        if failed := [name for name, r in systems.items() if "error" in r]:
            sys.exit(f"{len(failed)} of {len(systems)} systems failed ({', '.join(failed)}): "
                     "their errors are in the report")
    else:
        results = RESULTS_DIR if args.out is None else args.out / "results"
        doc = json.loads((results / f"{args.stem}.json").read_text())
        write_report(doc, args.stem, args.out)
        print(console(doc))
