"""`timewheel init`, and the offline commands' errors and human times."""
from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from storage import Record, ScheduleStore
from timewheel.app.cli import app
from timewheel.app.humantime import human_time

NOW = 1_795_460_400_000  # 2026-11-23 19:00 UTC


def run(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(app, list(args))
    return res.exit_code, res.output


def test_human_time_drops_only_zero_parts() -> None:
    assert human_time(NOW) == "2026-11-23 19:00Z"
    assert human_time(NOW + 5_250) == "2026-11-23 19:00:05.250Z"
    assert human_time(str(NOW + 61_000)) == "2026-11-23 19:01:01Z"


def test_a_missing_data_dir_names_the_command_that_makes_one(tmp_path: Path) -> None:
    d = tmp_path / "new"
    for cmd in (["inspect", "--data-dir", str(d)], ["backfill", "in.json", "--data-dir", str(d)],
                ["audit", "--data-dir", str(d)]):
        code, out = run(*cmd)
        assert code == 2, out
        assert f"timewheel init --data-dir {d}" in out, out
        assert not d.exists(), f"{cmd[0]} must not create the directory"


def test_init_makes_a_directory_backfill_and_inspect_accept(tmp_path: Path) -> None:
    d = tmp_path / "data"
    code, out = run("init", "--data-dir", str(d))
    assert code == 0 and "made a timewheel data directory" in out and "segments of 60 minutes" in out, out
    assert json.loads((d / "timewheel.json").read_text())["segment_minutes"] == 60
    code, out = run("init", "--data-dir", str(d))
    assert code == 0 and "already" in out, out
    code, out = run("init", "--data-dir", str(d), "--segment-minutes", "30")
    assert code == 2 and "segment_minutes=60" in out, out
    code, out = run("inspect", "--data-dir", str(d), "--json")
    assert code == 0 and json.loads(out)["segments"] == []


def test_init_refuses_a_directory_holding_other_files(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    code, out = run("init", "--data-dir", str(tmp_path))
    assert code == 2 and "not an empty directory" in out, out
    assert not (tmp_path / "timewheel.json").exists()


def test_inspect_names_segments_by_utc_time_and_json_keeps_epoch_ms(tmp_path: Path) -> None:
    with ScheduleStore(tmp_path / "data") as store:
        store.append([Record("m1", "ORDERS", b"x", NOW + 5_000)], NOW)
    code, out = run("inspect", "--data-dir", str(tmp_path / "data"))
    assert code == 0, out
    assert "2026-11-23 19:00Z" in out and str(NOW) not in out, out
    code, out = run("inspect", "--data-dir", str(tmp_path / "data"), "--json")
    assert json.loads(out)["segments"][0]["start_ms"] == NOW


def test_init_refuses_segments_of_zero_minutes_instead_of_taking_the_default(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["init", "--data-dir", str(tmp_path / "d"), "--segment-minutes", "0"])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert not (tmp_path / "d" / "timewheel.json").exists()
    assert "segment" in result.output, result.output
