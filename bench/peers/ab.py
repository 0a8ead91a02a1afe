"""`python -m bench.peers ab REV`: the performance targets' rows for another revision and this checkout, in turn.

Two runs of the same code differ here by as much as a tenth of the engine's CPU
(bench/RESULTS_HOTPATHS.md), so one run of each side cannot tell a change of that size. This
runs each `--bench` for REV (a git worktree, its compiled modules built in place) and for this
checkout alternately, `--pairs` times, keeps each run's results under `--out`, and writes and prints
each run's rows and each side's mean and spread (`--out`/ab.md):

- `peers`: `bench.peers run --system plain-hop --system timewheel` (the lateness and CPU rows);
- `capacity`: `bench.capacity` (ingest + delivery CPU a message, 1k/s delivery, resident bytes);
- `burst`: `bench.rocketmq_e2e --ingest 100000 --burst 200000 --intake-ceiling --skip-steady`.

`--bench peers --bench capacity --bench burst --pairs 2` is every target, about 70 minutes on 2 cores.

`--engine-only` runs this checkout's harness for both sides, REV's side with REV's engine (`timewheel
serve` started from its worktree): the pairs then differ by the engine alone, and a revision older
than today's rows (the Java clients' 10k/s phase, the reference rows) still gets them. `burst` runs
its engine in the harness's own process, so it cannot take another revision's: it is refused.

`--table` rebuilds ab.md from what `--out` holds, running nothing.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench.peers.ab_rows import BENCHES, BURST_COMMAND, all_rows, read_runs, run_files, table

REPO = Path(__file__).resolve().parents[2]


def _compiled_files(tree: Path) -> list[Path]:
    """The compiled modules built in a checkout, relative to it (`setup.py` builds them in these packages)."""
    return sorted(p.relative_to(tree) for top in ("storage", "forwarder") for p in (tree / top).rglob("*.so"))


def _worktree(rev: str, where: Path) -> Path:
    """A detached worktree of `rev` with the compiled modules this checkout has and `rev` has the sources
    of, built for it: copied when their sources are the same at `rev`, else built in a scratch environment
    (pip builds them so too); a revision from before the compiled modules gets none."""
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(where), rev], check=True)
    files = [f for f in _compiled_files(REPO) if (where / _source_of(f)).is_file()]
    if not files:
        return where
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


def _source_of(compiled: Path) -> Path:
    """The Cython source a compiled module is built from: x/_y.cpython-311-....so -> x/_y.pyx."""
    return compiled.with_name(compiled.name.split(".", 1)[0] + ".pyx")


def _logged(cmd: Sequence[str], tree: Path, log_path: Path) -> None:
    """Run `cmd` in `tree`, its output to `log_path`; stop the A/B runs if it fails."""
    with open(log_path, "w") as log:
        if subprocess.run(list(cmd), cwd=tree, stdout=log, stderr=subprocess.STDOUT).returncode:
            raise SystemExit(f"a run from {tree} failed: see {log_path}")


def _run(bench: str, tree: Path, out: Path, side: str, i: int, extra: Sequence[str],
         engine_only: bool = False) -> None:
    """One run of `bench` from `tree`, its results where `run_files` looks for them; with `engine_only`,
    this checkout's harness runs `tree`'s engine."""
    where = run_files(out, bench, side, i)[0]
    log_path = out / f"{bench}_{side}{i}.log"
    harness, engine = (REPO, [] if tree == REPO else ["--engine-tree", str(tree)]) if engine_only else (tree, [])
    if engine_only and bench not in ("peers", "capacity"):
        raise SystemExit(f"--engine-only cannot run {bench}: its engine runs in the harness's process")
    if bench == "peers":
        _logged([sys.executable, "-m", "bench.peers", "run", "--system", "plain-hop", "--system", "timewheel",
                 "--out", str(where.parents[1]), "--no-results-md", *engine, *extra], harness, log_path)
    elif engine_only:  # today's bench.capacity writes where it is told
        _logged([sys.executable, "-m", "bench.capacity", "--out", str(where), *engine], harness, log_path)
    elif bench == "burst":
        _logged([sys.executable, *BURST_COMMAND, "--out", str(where)], tree, log_path)
    else:
        # an older revision's bench.capacity writes only its tree's bench/results/capacity.json: run it
        # there, take the file, and put back what the tree had
        kept = tree / "bench" / "results" / "capacity.json"
        before = kept.read_bytes() if kept.is_file() else None
        try:
            _logged([sys.executable, "-m", "bench.capacity"], tree, log_path)
            shutil.copy2(kept, where)
        finally:
            if before is None:
                kept.unlink(missing_ok=True)
            else:
                kept.write_bytes(before)


def _write_table(out: Path) -> str:
    """ab.md from every run in `out`, the sides named as its ab.json says."""
    manifest = out / "ab.json"
    labels = json.loads(manifest.read_text()) if manifest.is_file() else {}
    runs = read_runs(out, labels)
    if not runs:
        raise SystemExit(f"{out} holds no A/B run's results")
    text = table(runs, all_rows())
    (out / "ab.md").write_text(text)
    return text


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of `python -m bench.peers ab`."""
    ap = argparse.ArgumentParser(prog="python -m bench.peers ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rev", nargs="?", help="the revision to compare this checkout with (e.g. HEAD~3, a commit)")
    ap.add_argument("--pairs", type=int, default=2, help="runs of each side, alternating (default %(default)s)")
    ap.add_argument("--bench", action="append", choices=list(BENCHES), dest="benches",
                    help="a benchmark each run runs (repeatable; default peers)")
    ap.add_argument("--out", type=Path, required=True, help="a directory for each run's results and log")
    ap.add_argument("--engine-only", action="store_true",
                    help="this checkout's harness for both sides, REV's engine on REV's side (peers, capacity)")
    ap.add_argument("--table", action="store_true", help="rebuild OUT/ab.md from the results OUT holds, run nothing")
    ap.epilog = "Flags after -- go to each `bench.peers run` (e.g. -- --steady-seconds 20)."
    given = list(sys.argv[1:] if argv is None else argv)
    cut = given.index("--") if "--" in given else len(given)
    args, extra = ap.parse_args(given[:cut]), given[cut + 1:]
    if args.table:
        print(_write_table(args.out))
        return
    if args.rev is None:
        ap.error("a revision to compare with is needed (or --table)")
    known = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{args.rev}^{{commit}}"],
                           capture_output=True)
    if known.returncode:
        raise SystemExit(f"{args.rev} is not a commit of {REPO}")
    benches = list(dict.fromkeys(args.benches or ["peers"]))
    if args.engine_only and "burst" in benches:
        ap.error("--engine-only runs peers and capacity: burst's engine runs in its harness's process")
    args.out.mkdir(parents=True, exist_ok=True)
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    base_label = f"{args.rev}'s engine" if args.engine_only else args.rev
    (args.out / "ab.json").write_text(json.dumps({"base": base_label, "head": f"this checkout ({head.stdout.strip()})"}))
    scratch = Path(tempfile.mkdtemp(prefix="timewheel-ab-"))
    base = scratch / "base"
    ran = False
    try:
        _worktree(args.rev, base)
        for i in range(1, args.pairs + 1):
            for side, tree in (("base", base), ("head", REPO)):
                for bench in benches:
                    print(f"run {bench} {args.rev if side == 'base' else 'this checkout'}#{i} ...", flush=True)
                    _run(bench, tree, args.out, side, i, extra, args.engine_only)
                    ran = True
    finally:
        if base.exists():  # also when REV could not be built: no worktree is left behind
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], check=False)
        shutil.rmtree(scratch, ignore_errors=True)
        if ran:
            print(_write_table(args.out))
