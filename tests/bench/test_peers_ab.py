"""The A/B runs' rows, read from a `bench.peers run` document."""
from __future__ import annotations

from pathlib import Path

import pytest

from bench.peers.ab_rows import PEERS_ROWS, target_rows, table


def _doc(engine_s: float, broker_s: float, p99: float, p50: float, low_engine_s: float) -> dict:
    cpu = {"101 python": engine_s, "102 broker": broker_s}
    return {"systems": {
        "timewheel": {
            "steady_high": {"accepted": 200_000, "warm_up_sent": 50_000, "server_cpu_s": cpu, "rate": 10_000,
                            "steady_window": {"seconds": 12.5, "server_cpu_s": {"101 python": 2.5, "102 broker": 10.0}},
                            "lateness_ms": {"p50": 5.0, "p99": p99}},
            "steady": {"accepted": 30_000, "server_cpu_s": {"101 python": low_engine_s, "102 broker": 14.0},
                       "lateness_ms": {"p50": p50, "p99": 6.0}},
            "batch_ingest": {"stored_per_s": 107_503}},
        "plain-hop": {"steady_high": {"lateness_ms": {"p50": 1.7, "p99": 40.0}},
                      "steady": {"lateness_ms": {"p50": 1.3, "p99": 16.0}}}}}


def test_the_rows_are_the_targets_figures_over_the_whole_phase() -> None:
    rows = target_rows(_doc(6.0, 20.0, 30.0, 1.6, 9.0))
    assert list(rows) == [name for name, _ in PEERS_ROWS]
    assert rows["10k/s engine ÷ broker CPU"] == pytest.approx(0.3)
    assert rows["10k/s engine CPU µs a message"] == pytest.approx(24.0), "the warm-up's messages ran in the phase"
    assert rows["10k/s engine ÷ broker CPU, steady window"] == pytest.approx(0.25)
    assert rows["10k/s engine CPU µs a message, steady window"] == pytest.approx(20.0), "10,000 a second × 12.5 s"
    assert rows["10k/s p99 ÷ plain hop p99"] == pytest.approx(0.75)
    assert rows["1k/s p50 − plain hop p50, ms"] == pytest.approx(0.3)
    assert rows["1k/s engine CPU µs a message"] == pytest.approx(300.0)
    assert rows["batch ingest, stored a second"] == 107_503


def test_a_run_without_a_phase_leaves_its_rows_empty_and_the_table_says_so() -> None:
    doc = _doc(6.0, 20.0, 30.0, 1.6, 9.0)
    del doc["systems"]["plain-hop"]
    rows = target_rows(doc)
    assert rows["10k/s p99 ÷ plain hop p99"] is None and rows["1k/s p50 − plain hop p50, ms"] is None
    text = table([("base#1", rows), ("head#1", target_rows(_doc(5.0, 20.0, 30.0, 1.6, 8.0)))])
    line = next(x for x in text.splitlines() if x.startswith("| 10k/s engine ÷ broker CPU"))
    assert "0.300" in line and "0.250" in line and "0.250 (0.250–0.250)" in line
    p99 = next(x for x in text.splitlines() if x.startswith("| 10k/s p99")).strip("| ").split(" | ")
    assert p99[2:] == ["–", "0.750", "–", "0.750 (0.750–0.750)"], "the run without a plain hop has no ratio"


def test_a_run_without_a_steady_window_leaves_its_rows_empty() -> None:
    doc = _doc(6.0, 20.0, 30.0, 1.6, 9.0)
    del doc["systems"]["timewheel"]["steady_high"]["steady_window"]
    rows = target_rows(doc)
    assert rows["10k/s engine ÷ broker CPU, steady window"] is None
    assert rows["10k/s engine ÷ broker CPU"] == pytest.approx(0.3)


def test_the_other_side_is_a_worktree_of_the_revision_with_this_checkout_s_compiled_modules(tmp_path: Path) -> None:
    import subprocess

    from bench.peers.ab import REPO, _compiled_files, _worktree

    files = _compiled_files(REPO)
    assert files, "`make setup` builds the compiled modules in place"
    where = _worktree("HEAD", tmp_path / "base")  # the same sources: copied, then each import checked there
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
        tree = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
        assert tree == head
        assert all((where / f).is_file() for f in files)
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(where)], check=True)


def test_a_revision_that_is_not_a_commit_is_refused_before_any_run(tmp_path: Path) -> None:
    from bench.peers.ab import main

    with pytest.raises(SystemExit, match="is not a commit"):
        main(["no-such-revision", "--out", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


def test_the_report_says_how_long_the_steady_windows_threads_waited_for_a_cpu() -> None:
    from bench.peers.report import floor_tables

    doc = _doc(6.0, 20.0, 30.0, 1.6, 9.0)
    doc["config"] = {"steady_rate": 1000, "burst": 2000}
    doc["machine"] = {"cpus": 3}  # the machine that ran it, not the one that reads the JSON
    window = doc["systems"]["timewheel"]["steady_high"]["steady_window"]
    window["run_queue_s"] = {"101 python": 0.25, "102 broker": 1.5}
    text = floor_tables(doc)
    assert "engine ÷ broker **0.250**" in text
    assert "the engine's 20 ms a second, the broker's 120 ms a second" in text, "12.5 s of window"
    assert "the machine's 3 CPUs" in text
    del window["run_queue_s"]
    assert "run queue" not in floor_tables(doc), "a run from before it was sampled says nothing of it"


def _capacity_doc(ingest: float, delivery: float, low: float, p99: float, rss: float) -> dict:
    return {"measured": {"ingest": {"cpu_us_per_message": ingest}, "low_due_rate": 1000,
                         "delivery": {"due_per_s": 10_000, "cpu_us_per_message": delivery, "lateness_ms": {"p99": p99}},
                         "delivery_1000": {"due_per_s": 1000, "cpu_us_per_message": low},
                         "loaded": {"rss_bytes_per_entry": rss}}}


def _burst_doc(p99_ms: float, dispatched: float, ceiling: float, stored: float) -> dict:
    return {"intake_ceiling": {"rate": ceiling}, "ingest": {"per_s_after_first_stored": stored},
            "dispatch": {"per_s": dispatched, "engine_send_lateness_ms": {"p99": p99_ms}}}


def test_the_capacity_and_burst_rows_are_the_targets_figures() -> None:
    from bench.peers.ab_rows import burst_rows, capacity_rows

    cap = capacity_rows(_capacity_doc(24.0, 19.0, 400.0, 8_000.0, 14.5))
    assert cap["capacity: ingest + delivery µs a message"] == pytest.approx(43.0)
    assert cap["capacity: delivery µs a message at 1k/s"] == 400.0
    assert cap["capacity: resident bytes a loaded message"] == 14.5
    burst = burst_rows(_burst_doc(3_010.0, 60_000.0, 30_000.0, 28_000.0))
    assert burst["burst: 200k p99, s"] == pytest.approx(3.01)
    assert burst["burst: dispatch ÷ intake ceiling"] == pytest.approx(2.0)
    assert burst_rows({"dispatch": {"per_s": 1.0}})["burst: dispatch ÷ intake ceiling"] is None, "no ceiling measured"


def test_the_table_is_rebuilt_from_the_directory_alone_pair_by_pair(tmp_path: Path) -> None:
    import json

    from bench.peers.ab import main

    out = tmp_path / "ab"
    (out / "head1" / "results").mkdir(parents=True)
    (out / "head1" / "results" / "peers.json").write_text(json.dumps(_doc(5.0, 20.0, 30.0, 1.6, 8.0)))
    (out / "ab_base1.json").write_text(json.dumps(_doc(6.0, 20.0, 30.0, 1.6, 9.0)))  # a copied peers.json
    for side, i, us in (("base", 1, 30.0), ("head", 1, 20.0), ("base", 2, 32.0), ("head", 2, 22.0)):
        (out / f"capacity_{side}{i}.json").write_text(json.dumps(_capacity_doc(us, 10.0, 300.0, 50.0, 14.0)))
    (out / "burst_head2.json").write_text(json.dumps(_burst_doc(1_500.0, 30_000.0, 40_000.0, 28_000.0)))
    (out / "ab.json").write_text(json.dumps({"base": "abc1234", "head": "this checkout"}))
    main(["--table", "--out", str(out)])
    lines = (out / "ab.md").read_text().splitlines()
    assert lines[0].split(" | ")[2:] == ["abc1234#1", "this checkout#1", "abc1234#2", "this checkout#2",
                                         "abc1234 mean (range)", "this checkout mean (range) |"]
    cells = next(x for x in lines if x.startswith("| capacity: ingest + delivery")).strip("| ").split(" | ")
    assert cells[1:] == ["≤ 20", "40.00", "30.00", "42.00", "32.00", "41.00 (40.00–42.00)", "31.00 (30.00–32.00)"]
    engine = next(x for x in lines if x.startswith("| 10k/s engine ÷ broker CPU |")).strip("| ").split(" | ")
    assert engine[2:6] == ["0.300", "0.250", "–", "–"], "pair 2 ran no peers run"
    burst = next(x for x in lines if x.startswith("| burst: dispatch ÷ intake ceiling")).strip("| ").split(" | ")
    assert burst[2:6] == ["–", "–", "–", "0.750"]


def test_an_older_revisions_capacity_run_is_taken_from_its_tree_and_the_tree_is_left_as_it_was(tmp_path: Path) -> None:
    from bench.peers.ab import _run

    tree, out = tmp_path / "tree", tmp_path / "out"
    (tree / "bench" / "results").mkdir(parents=True)
    out.mkdir()
    (tree / "bench" / "__init__.py").write_text("")
    # what bench.capacity did before it had --out: write the tree's own results file
    (tree / "bench" / "capacity.py").write_text(
        "from pathlib import Path\nPath('bench/results/capacity.json').write_text('{\"measured\": {}}')\n")
    (tree / "bench" / "results" / "capacity.json").write_text("committed")
    _run("capacity", tree, out, "base", 1, [])
    assert (out / "capacity_base1.json").read_text() == '{"measured": {}}'
    assert (tree / "bench" / "results" / "capacity.json").read_text() == "committed"
    (tree / "bench" / "capacity.py").write_text("raise SystemExit(3)\n")
    with pytest.raises(SystemExit, match="failed: see"):
        _run("capacity", tree, out, "head", 1, [])
    assert (tree / "bench" / "results" / "capacity.json").read_text() == "committed"


def test_ab_without_a_revision_or_table_says_what_it_needs(tmp_path: Path) -> None:
    from bench.peers.ab import main

    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="holds no A/B run"):
        main(["--table", "--out", str(tmp_path)])


def test_a_revision_from_before_the_compiled_modules_gets_a_worktree_without_them(tmp_path: Path) -> None:
    import subprocess

    from bench.peers.ab import REPO, _worktree

    added = subprocess.run(["git", "-C", str(REPO), "log", "--diff-filter=A", "--format=%H", "--", "*.pyx"],
                           capture_output=True, text=True, check=True).stdout.split()
    before = f"{added[-1]}~1"  # the first .pyx's parent: no compiled module, no setup.py to build one
    where = _worktree(before, tmp_path / "base")
    try:
        assert (where / "timewheel" / "__main__.py").is_file()
        assert not list(where.rglob("*.so")), "nothing of this checkout's build is copied into it"
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(where)], check=True)


def test_engine_only_runs_this_checkouts_harness_with_the_revisions_engine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import bench.peers.ab as ab

    ran: list[tuple[list[str], Path]] = []
    monkeypatch.setattr(ab, "_logged", lambda cmd, tree, log: ran.append((list(cmd), tree)))
    base, out = tmp_path / "base", tmp_path / "out"
    ab._run("peers", base, out, "base", 1, ["--steady-seconds", "5"], engine_only=True)
    ab._run("capacity", base, out, "base", 1, [], engine_only=True)
    ab._run("capacity", ab.REPO, out, "head", 1, [], engine_only=True)
    (peers, peers_tree), (cap, cap_tree), (head, _) = ran
    assert peers_tree == cap_tree == ab.REPO, "the harness is this checkout's"
    assert peers[peers.index("--engine-tree") + 1] == str(base)
    assert peers[-2:] == ["--steady-seconds", "5"]
    assert cap[cap.index("--engine-tree") + 1] == str(base)
    assert cap[cap.index("--out") + 1] == str(out / "capacity_base1.json")
    assert "--engine-tree" not in head, "this checkout's side runs its own engine"
    with pytest.raises(SystemExit, match="cannot run burst"):
        ab._run("burst", base, out, "base", 1, [], engine_only=True)
    with pytest.raises(SystemExit):
        ab.main(["HEAD", "--engine-only", "--bench", "burst", "--out", str(out)])


def test_a_report_with_no_anomaly_says_which_it_looked_for() -> None:
    from bench.peers.report import observations

    doc = _doc(6.0, 20.0, 30.0, 1.6, 9.0)
    doc["config"] = {"steady_rate": 1000, "burst": 2000, "burst_lead_s": 15.0}
    for phase in ("steady", "steady_high"):
        doc["systems"]["timewheel"][phase]["received"] = doc["systems"]["timewheel"][phase]["accepted"]
    clean = observations(doc)
    assert clean.startswith("- None of the anomalies") and "duplicates" in clean and "stalled" in clean
    doc["systems"]["timewheel"]["steady"]["received"] = 29_990
    assert observations(doc) == "- timewheel, steady: 10 of 30,000 accepted messages never reached the consumer.\n"
