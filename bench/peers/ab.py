"""`python -m bench.peers ab REV`: the performance targets' rows for another revision and this checkout, in turn.

Two runs of the same code differ here by as much as a tenth of the engine's CPU
(bench/RESULTS_HOTPATHS.md), so one run of each side cannot tell a change of that size. This
runs `bench.peers run --system plain-hop --system timewheel` for REV (a git worktree, its compiled
modules built in place) and for this checkout alternately, `--pairs` times, keeps each run's
results under `--out`, and prints each run's rows and each side's mean and spread.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench.peers.cpu import window_cpu

REPO = Path(__file__).resolve().parents[2]

#: the rows the performance targets are stated in (bench/RESULTS_HOTPATHS.md): name, target
ROWS: tuple[tuple[str, str], ...] = (
    ("10k/s engine ÷ broker CPU", "≤ 0.3"),
    ("10k/s engine CPU µs a message", ""),
    ("10k/s engine ÷ broker CPU, steady window", "≤ 0.3"),
    ("10k/s engine CPU µs a message, steady window", ""),
    ("10k/s p99 ÷ plain hop p99", "≤ 2"),
    ("1k/s p50 − plain hop p50, ms", "≤ +1"),
    ("1k/s engine CPU µs a message", "≤ 100"),
    ("batch ingest, stored a second", "≥ 100,000"),
)


def _phase_cpu(system: dict, phase: str) -> tuple[float, float, int] | None:
    """(engine CPU s, broker CPU s, messages) of a phase: the engine is every sampled process but the broker."""
    p = system.get(phase) or {}
    cpu, n = p.get("server_cpu_s"), p.get("accepted")
    if not isinstance(cpu, dict) or not cpu or not isinstance(n, int) or not n:
        return None
    engine = sum(v for k, v in cpu.items() if "broker" not in k)
    return engine, sum(cpu.values()) - engine, n + int(p.get("warm_up_sent") or 0)


def _lateness(system: dict, phase: str, q: str) -> float | None:
    got = ((system.get(phase) or {}).get("lateness_ms") or {}).get(q)
    return float(got) if isinstance(got, (int, float)) else None


def target_rows(doc: dict) -> dict[str, float | None]:
    """The rows of `ROWS` from one `bench.peers run` document (None where the run lacks them)."""
    tw, hop = doc["systems"].get("timewheel") or {}, doc["systems"].get("plain-hop") or {}
    high, low = _phase_cpu(tw, "steady_high"), _phase_cpu(tw, "steady")
    win = window_cpu(tw, "steady_high")
    p99, hop_p99 = _lateness(tw, "steady_high", "p99"), _lateness(hop, "steady_high", "p99")
    p50, hop_p50 = _lateness(tw, "steady", "p50"), _lateness(hop, "steady", "p50")
    stored = (tw.get("batch_ingest") or {}).get("stored_per_s")
    return dict(zip((name for name, _ in ROWS), (
        high[0] / high[1] if high and high[1] else None,
        high[0] / high[2] * 1e6 if high else None,
        win[0] / win[1] if win and win[1] else None,
        win[0] / win[2] * 1e6 if win else None,
        p99 / hop_p99 if p99 is not None and hop_p99 else None,
        p50 - hop_p50 if p50 is not None and hop_p50 is not None else None,
        low[0] / low[2] * 1e6 if low else None,
        float(stored) if isinstance(stored, (int, float)) else None)))


def _fmt(x: float | None) -> str:
    if x is None:
        return "–"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3f}" if abs(x) < 1 else f"{x:.2f}"


def table(runs: Sequence[tuple[str, dict[str, float | None]]]) -> str:
    """Markdown: one column a run, then each side's mean and range (sides named before the run's '#')."""
    sides = list(dict.fromkeys(label.split("#")[0] for label, _ in runs))
    head = [label for label, _ in runs] + [f"{s} mean (range)" for s in sides]
    out = ["| figure | target | " + " | ".join(head) + " |", "| --- | --- |" + " ---: |" * len(head)]
    for name, target in ROWS:
        cells = [_fmt(rows[name]) for _, rows in runs]
        for s in sides:
            got = [v for label, rows in runs if label.split("#")[0] == s and (v := rows[name]) is not None]
            cells.append(f"{_fmt(statistics.fmean(got))} ({_fmt(min(got))}–{_fmt(max(got))})" if got else "–")
        out.append(f"| {name} | {target} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def _compiled_files(tree: Path) -> list[Path]:
    """The compiled modules built in a checkout, relative to it (`setup.py` builds them in these packages)."""
    return sorted(p.relative_to(tree) for top in ("storage", "forwarder") for p in (tree / top).rglob("*.so"))


def _worktree(rev: str, where: Path) -> Path:
    """A detached worktree of `rev` with the compiled modules this checkout has, built for it: copied when
    their sources are the same at `rev`, else built in a scratch environment (pip builds them so too)."""
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(where), rev], check=True)
    files = _compiled_files(REPO)
    same = subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", rev, "--", "setup.py", "*.pyx", "*.pxd"])
    if same.returncode == 0:
        for f in files:
            shutil.copy2(REPO / f, where / f)
    else:
        env = where.parent / "build-env"
        subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
        subprocess.run([str(env / "bin" / "pip"), "install", "-q", "setuptools>=77", "Cython>=3.0,<4"], check=True)
        subprocess.run([str(env / "bin" / "python"), "setup.py", "-q", "build_ext", "--inplace"], cwd=where, check=True)
    modules = [".".join(f.with_suffix("").with_suffix("").parts) for f in files]  # x/_y.cpython-311-...so: x._y
    # a module left out (the build only warns) would compare a pure-Python path with a compiled one
    check = "import importlib, sys; sys.exit(not importlib.import_module(sys.argv[1]).__file__.startswith(sys.argv[2]))"
    missing = [m for m in modules
               if subprocess.run([sys.executable, "-c", check, m, str(where)], cwd=where, capture_output=True).returncode]
    if missing:
        raise SystemExit(f"{rev}'s compiled modules {', '.join(missing)} could not be built: see `make setup`")
    return where


def _run(tree: Path, out: Path, extra: Sequence[str]) -> dict[str, float | None]:
    """One `bench.peers run` of the plain hop and timewheel from `tree`; its rows."""
    cmd = [sys.executable, "-m", "bench.peers", "run", "--system", "plain-hop", "--system", "timewheel",
           "--out", str(out), "--no-results-md", *extra]
    log_path = out.with_suffix(".log")
    with open(log_path, "w") as log:
        if subprocess.run(cmd, cwd=tree, stdout=log, stderr=subprocess.STDOUT).returncode:
            raise SystemExit(f"a run from {tree} failed: see {log_path}")
    return target_rows(json.loads((out / "results" / "peers.json").read_text()))


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of `python -m bench.peers ab`."""
    ap = argparse.ArgumentParser(prog="python -m bench.peers ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rev", help="the revision to compare this checkout with (e.g. HEAD~3, a commit)")
    ap.add_argument("--pairs", type=int, default=2, help="runs of each side, alternating (default %(default)s)")
    ap.add_argument("--out", type=Path, required=True, help="a directory for each run's results and log")
    ap.epilog = "Flags after -- go to each `bench.peers run` (e.g. -- --steady-seconds 20)."
    given = list(sys.argv[1:] if argv is None else argv)
    cut = given.index("--") if "--" in given else len(given)
    args, extra = ap.parse_args(given[:cut]), given[cut + 1:]
    known = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{args.rev}^{{commit}}"],
                           capture_output=True)
    if known.returncode:
        raise SystemExit(f"{args.rev} is not a commit of {REPO}")
    args.out.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="timewheel-ab-"))
    runs: list[tuple[str, dict[str, float | None]]] = []
    base = scratch / "base"
    try:
        _worktree(args.rev, base)
        for i in range(1, args.pairs + 1):
            for side, tree in ((args.rev, base), ("this checkout", REPO)):
                label = f"{side}#{i}"
                print(f"run {label} ...", flush=True)
                runs.append((label, _run(tree, args.out / f"{'base' if tree is base else 'head'}{i}", extra)))
    finally:
        if base.exists():  # also when REV could not be built: no worktree is left behind
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], check=False)
        shutil.rmtree(scratch, ignore_errors=True)
        if runs:
            text = table(runs)
            (args.out / "ab.md").write_text(text)
            print(text)
