"""A `bench.peers run` whose every system failed: a report and a chart that say so, and a non-zero exit."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.peers import cli

ROOT = Path(__file__).resolve().parents[2]


def test_a_run_whose_systems_all_failed_reports_them_and_exits_non_zero(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    doc: dict[str, Any] = json.loads((ROOT / "bench" / "results" / "peers.json").read_text())
    doc["systems"] = {name: {"error": "ModuleNotFoundError: No module named 'psutil'"}
                      for name in ("plain-hop", "timewheel")}
    monkeypatch.setattr(cli, "run_fast_switch", lambda cfg, command: doc)
    monkeypatch.setattr(cli, "_require_bench_extras", lambda systems: None)  # the suite's environment lacks them
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run", "--system", "plain-hop", "--system", "timewheel", "--out", str(tmp_path)])
    assert "2 of 2 systems failed (plain-hop, timewheel)" in str(exit_.value.code)
    assert (tmp_path / "results" / "peers.png").stat().st_size > 0
    assert "No module named 'psutil'" in (tmp_path / "RESULTS.md").read_text()


@pytest.mark.parametrize(("system", "module"), [("timewheel", "psutil"), ("redis-zset", "redis"),
                                                ("postgres", "psycopg")])
def test_a_run_without_a_module_its_systems_need_names_the_install_command(
        monkeypatch: pytest.MonkeyPatch, system: str, module: str) -> None:
    import importlib.util

    # only `module` missing, whatever the suite's environment holds
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else object())
    monkeypatch.setattr(cli, "run_fast_switch", lambda cfg, command: pytest.fail("ran without its extras"))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run", "--system", system])
    assert f"needs {module}:" in str(exit_.value.code) and "[dev,bench]" in str(exit_.value.code)


def test_a_run_asks_only_for_the_modules_of_its_systems(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    # psutil there (the suite's environment may lack it), the other two systems' modules not
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("redis", "psycopg") else object())
    ran: list[object] = []

    def run(cfg: object, command: str) -> dict[str, object]:
        ran.append(cfg)
        return {"systems": {}}

    monkeypatch.setattr(cli, "run_fast_switch", run)
    monkeypatch.setattr(cli, "write_report", lambda *a: None)
    monkeypatch.setattr(cli, "console", lambda doc: "")
    cli.main(["run", "--system", "timewheel", "--out", "unused"])
    assert len(ran) == 1
