"""The Spark commands refuse a flag out of its range before a Spark session starts: exit 2, in
the words of every range error of the CLI (as `find --limit`), never a Spark traceback."""
from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.timewheel.app._refusals import forbid_spark
from timewheel.app.cli import app


@pytest.fixture
def data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An initialised data directory, with Spark sessions forbidden."""
    forbid_spark(monkeypatch, "a flag")
    data = tmp_path / "data"
    assert CliRunner().invoke(app, ["init", "--data-dir", str(data)]).exit_code == 0
    return data


def _input(tmp_path: Path) -> str:
    path = tmp_path / "rows.json"
    path.write_text('{"topic": "ORDERS", "body": "x", "deliver_at_ms": 1}\n')
    return str(path)


@pytest.mark.parametrize(("command", "flag", "value"), [
    (["audit"], "--grace-seconds", "-1"),
    (["replay", "--since", "0", "--until", "1000", "--dry-run"], "--rate", "-1"),
    (["replay", "--since", "0", "--until", "1000", "--dry-run"], "--show", "-1"),
    (["backfill", "INPUT"], "--max-delay-ms", "-1"),
    (["backfill", "INPUT"], "--max-body-bytes", "-1"),
    (["backfill", "INPUT"], "--partitions", "0"),
], ids=lambda v: v if isinstance(v, str) else v[0])
def test_a_flag_out_of_its_range_is_refused_before_spark_starts(tmp_path: Path, data_dir: Path, command: list[str],
                                                               flag: str, value: str) -> None:
    argv = [_input(tmp_path) if a == "INPUT" else a for a in command]
    res = CliRunner().invoke(app, [*argv, "--data-dir", str(data_dir), flag, value])
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output, res.output
    assert f"Invalid value for '{flag}': Input should be greater than or equal to" in res.output, res.output


@pytest.mark.parametrize(("command", "flag", "value"), [
    (["audit"], "--grace-seconds", "inf"),
    (["replay", "--since", "0", "--until", "1000", "--dry-run"], "--rate", "inf"),
], ids=lambda v: v if isinstance(v, str) else v[0])
def test_a_flag_that_is_not_a_finite_number_is_refused_before_spark_starts(
        data_dir: Path, command: list[str], flag: str, value: str) -> None:
    # the range check lets infinity through (NaN is refused by it): the audit then failed on int(inf)
    res = CliRunner().invoke(app, [*command, "--data-dir", str(data_dir), flag, value])
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert res.exit_code == 2, res.output
    assert f"{flag} must be a finite number" in res.output, res.output
