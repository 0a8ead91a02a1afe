"""The Spark commands' tables name segments and due times in UTC, as people read them."""
from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from storage import Record, ScheduleStore
from timewheel.app.cli import app

# the one PySpark warning the Spark tests also ignore (tests/spark/conftest.py): not ours to fix
pytestmark = [pytest.mark.spark,
              pytest.mark.filterwarnings("ignore:PySpark does not yet fully support pandas:FutureWarning")]

NOW = 1_795_460_400_000  # 2026-11-23 19:00 UTC


def test_audit_and_replay_tables_show_utc_times(tmp_path: Path) -> None:
    data = tmp_path / "data"
    with ScheduleStore(data) as store:
        store.append([Record(f"m{i}", "ORDERS", b"x", NOW + 5_000 + i) for i in range(3)], NOW)
    runner = CliRunner()
    res = runner.invoke(app, ["audit", "--data-dir", str(data), "--now", str(NOW), "--master", "local[1]",
                              "--out", str(tmp_path / "audit")])
    assert res.exit_code == 0, res.output
    assert "2026-11-23 19:00Z" in res.output and "202611231900" not in res.output, res.output
    res = runner.invoke(app, ["replay", "--data-dir", str(data), "--since", str(NOW), "--until", str(NOW + 60_000),
                              "--dry-run", "--namesrv", "127.0.0.1:9", "--master", "local[1]"])
    assert res.exit_code == 0, res.output
    assert "2026-11-23 19:00:05Z" in res.output and "due in [2026-11-23 19:00Z, 2026-11-23 19:01Z)" in res.output, \
        res.output
