"""The performance targets' rows, read from each benchmark's results, and the A/B table of them.

Three benchmarks carry the targets (bench/RESULTS_HOTPATHS.md): `bench.peers run` (`PEERS_ROWS`),
`bench.capacity` (`CAPACITY_ROWS`) and the 200k burst of `bench.rocketmq_e2e` (`BURST_ROWS`). An
A/B directory keeps each run's results under the names `run_files` gives, so that the table can be
rebuilt from it alone (`python -m bench.peers ab --table DIR`).
"""
from __future__ import annotations

import json
import re
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.peers.cpu import window_cpu

Rows = dict[str, float | None]

#: the rows `bench.peers run` gives: name, target
PEERS_ROWS: tuple[tuple[str, str], ...] = (
    ("10k/s engine ÷ broker CPU", "≤ 0.3"),
    ("10k/s engine CPU µs a message", ""),
    ("10k/s engine ÷ broker CPU, steady window", "≤ 0.3"),
    ("10k/s engine CPU µs a message, steady window", ""),
    ("10k/s p99 ÷ plain hop p99", "≤ 2"),
    ("1k/s p50 − plain hop p50, ms", "≤ +1"),
    ("1k/s engine CPU µs a message", "≤ 100"),
    ("batch ingest, stored a second", "≥ 100,000"),
)

#: the rows `bench.capacity` gives
CAPACITY_ROWS: tuple[tuple[str, str], ...] = (
    ("capacity: ingest µs a message", ""),
    ("capacity: delivery µs a message at 10k/s", ""),
    ("capacity: ingest + delivery µs a message", "≤ 20"),
    ("capacity: delivery µs a message at 1k/s", "≤ 100"),
    ("capacity: delivery p99 at 10k/s, ms", ""),
    ("capacity: resident bytes a loaded message", "≤ 24"),
)

#: the rows the 200k burst gives (`bench.rocketmq_e2e --ingest 100000 --burst 200000 --intake-ceiling --skip-steady`)
BURST_ROWS: tuple[tuple[str, str], ...] = (
    ("burst: 200k p99, s", "≤ 2"),
    ("burst: dispatched a second", ""),
    ("burst: intake ceiling a second", ""),
    ("burst: dispatch ÷ intake ceiling", "≥ 0.7"),
    ("burst: ingest stored a second", ""),
)

#: the command each benchmark runs in an A/B pair (the peers run's flags are `ab`'s own, after --)
BURST_COMMAND = ("-m", "bench.rocketmq_e2e", "--ingest", "100000", "--burst", "200000", "--intake-ceiling",
                 "--skip-steady")


def _phase_cpu(system: dict, phase: str) -> tuple[float, float, int] | None:
    """(engine CPU s, broker CPU s, messages) of a phase: the engine is every sampled process but the broker."""
    p = system.get(phase) or {}
    cpu, n = p.get("server_cpu_s"), p.get("accepted")
    if not isinstance(cpu, dict) or not cpu or not isinstance(n, int) or not n:
        return None
    engine = sum(v for k, v in cpu.items() if "broker" not in k)
    return engine, sum(cpu.values()) - engine, n + int(p.get("warm_up_sent") or 0)


def _number(x: object) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _at(doc: dict, *path: str) -> float | None:
    """The number at `path` in a results document, or None where the run lacks it."""
    node: object = doc
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    return _number(node)


def target_rows(doc: dict) -> Rows:
    """The rows of `PEERS_ROWS` from one `bench.peers run` document (None where the run lacks them)."""
    tw, hop = doc["systems"].get("timewheel") or {}, doc["systems"].get("plain-hop") or {}
    high, low = _phase_cpu(tw, "steady_high"), _phase_cpu(tw, "steady")
    win = window_cpu(tw, "steady_high")
    p99, hop_p99 = _at(tw, "steady_high", "lateness_ms", "p99"), _at(hop, "steady_high", "lateness_ms", "p99")
    p50, hop_p50 = _at(tw, "steady", "lateness_ms", "p50"), _at(hop, "steady", "lateness_ms", "p50")
    return dict(zip((name for name, _ in PEERS_ROWS), (
        high[0] / high[1] if high and high[1] else None,
        high[0] / high[2] * 1e6 if high else None,
        win[0] / win[1] if win and win[1] else None,
        win[0] / win[2] * 1e6 if win else None,
        p99 / hop_p99 if p99 is not None and hop_p99 else None,
        p50 - hop_p50 if p50 is not None and hop_p50 is not None else None,
        low[0] / low[2] * 1e6 if low else None,
        _at(tw, "batch_ingest", "stored_per_s"))))


def capacity_rows(doc: dict) -> Rows:
    """The rows of `CAPACITY_ROWS` from one `bench.capacity` results file."""
    m = doc.get("measured") or {}
    ingest, delivery = _at(m, "ingest", "cpu_us_per_message"), _at(m, "delivery", "cpu_us_per_message")
    low = m.get(f"delivery_{m.get('low_due_rate')}") or {}
    return dict(zip((name for name, _ in CAPACITY_ROWS), (
        ingest, delivery,
        ingest + delivery if ingest is not None and delivery is not None else None,
        _at(low, "cpu_us_per_message"),
        _at(m, "delivery", "lateness_ms", "p99"),
        _at(m, "loaded", "rss_bytes_per_entry"))))


def burst_rows(doc: dict) -> Rows:
    """The rows of `BURST_ROWS` from one `bench.rocketmq_e2e` results file."""
    p99 = _at(doc, "dispatch", "engine_send_lateness_ms", "p99")
    dispatched, ceiling = _at(doc, "dispatch", "per_s"), _at(doc, "intake_ceiling", "rate")
    return dict(zip((name for name, _ in BURST_ROWS), (
        p99 / 1000 if p99 is not None else None,
        dispatched, ceiling,
        dispatched / ceiling if dispatched is not None and ceiling else None,
        _at(doc, "ingest", "per_s_after_first_stored"))))


#: each benchmark of a pair: its rows, and how its results file's rows are read
BENCHES: dict[str, tuple[tuple[tuple[str, str], ...], Callable[[dict], Rows]]] = {
    "peers": (PEERS_ROWS, target_rows),
    "capacity": (CAPACITY_ROWS, capacity_rows),
    "burst": (BURST_ROWS, burst_rows),
}


def run_files(out: Path, bench: str, side: str, i: int) -> list[Path]:
    """Where run `i` of `side` ('base' or 'head') keeps `bench`'s results in an A/B directory, in the
    order they are looked for (the peers run's own directory, or its JSON copied as ab_SIDEi.json)."""
    if bench == "peers":
        return [out / f"{side}{i}" / "results" / "peers.json", out / f"ab_{side}{i}.json"]
    return [out / f"{bench}_{side}{i}.json"]


def _fmt(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3f}" if abs(x) < 1 else f"{x:.2f}"


def table(runs: Sequence[tuple[str, Rows]], rows: Sequence[tuple[str, str]] = PEERS_ROWS) -> str:
    """Markdown: one column a run, then each side's mean and range (sides named before the run's '#');
    a row no run has is left out."""
    sides = list(dict.fromkeys(label.split("#")[0] for label, _ in runs))
    head = [label for label, _ in runs] + [f"{s} mean (range)" for s in sides]
    out = ["| figure | target | " + " | ".join(head) + " |", "| --- | --- |" + " ---: |" * len(head)]
    for name, target in rows:
        if all(got.get(name) is None for _, got in runs):
            continue
        cells = [_fmt(got.get(name)) for _, got in runs]
        for s in sides:
            vals = [v for label, got in runs if label.split("#")[0] == s and (v := got.get(name)) is not None]
            cells.append(f"{_fmt(statistics.fmean(vals))} ({_fmt(min(vals))}–{_fmt(max(vals))})" if vals else "–")
        out.append(f"| {name} | {target} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def read_runs(out: Path, labels: dict[str, str]) -> list[tuple[str, Rows]]:
    """Every run's rows in an A/B directory, pair by pair, base before head; `labels` names the sides."""
    found: set[tuple[int, str]] = set()
    for path in out.rglob("*.json"):
        rel = path.relative_to(out).as_posix()
        if m := re.fullmatch(r"(?:(?:ab|capacity|burst)_)?(base|head)(\d+)(?:\.json|/results/peers\.json)", rel):
            found.add((int(m.group(2)), m.group(1)))
    runs: list[tuple[str, Rows]] = []
    for i, side in sorted(found, key=lambda k: (k[0], k[1] != "base")):
        rows: Rows = {}
        for bench, (_, read) in BENCHES.items():
            run_file = next((p for p in run_files(out, bench, side, i) if p.is_file()), None)
            if run_file is not None:
                rows.update(read(json.loads(run_file.read_text())))
        runs.append((f"{labels.get(side, side)}#{i}", rows))
    return runs


def all_rows() -> tuple[tuple[str, str], ...]:
    """Every benchmark's rows, in `BENCHES` order."""
    return tuple(r for rows, _ in BENCHES.values() for r in rows)
