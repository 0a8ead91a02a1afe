"""A config file or a backfill input the command cannot read is refused in one line, exit 2, no traceback."""
from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.timewheel.app._refusals import forbid_spark, refused
from timewheel.app.cli import app


@pytest.fixture
def no_spark(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Spark commands must refuse these inputs before a session starts."""
    forbid_spark(monkeypatch, "an input")



def _data_dir(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    assert CliRunner().invoke(app, ["init", "--data-dir", str(data)]).exit_code == 0
    return data


def _configs(tmp_path: Path) -> dict[str, Path]:
    """A config path of each kind no TOML can be read from."""
    folder = tmp_path / "conf.d"
    folder.mkdir()
    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b'[rocketmq]\nnamesrv = "h\xf4te:9876"\n')
    return {"a directory": folder, "not UTF-8": latin1}


_COMMANDS = [["serve", "--print-config"],
             ["send", "--topic", "ORDERS", "--body", "x", "--delay", "5s"],
             ["replay", "--since", "0", "--until", "1000", "--dry-run"]]


@pytest.mark.parametrize("kind", ["a directory", "not UTF-8"])
@pytest.mark.parametrize("command", _COMMANDS, ids=lambda c: c[0])
def test_a_config_file_that_cannot_be_read_is_refused_naming_it(tmp_path: Path, no_spark: None, kind: str,
                                                               command: list[str]) -> None:
    path = _configs(tmp_path)[kind]
    data = ["--data-dir", str(_data_dir(tmp_path))] if command[0] in ("serve", "replay") else []
    res = CliRunner().invoke(app, [*command, *data, "--config", str(path)])
    refused(res, str(path))


def test_a_backfill_input_that_does_not_exist_is_refused_before_spark_starts(tmp_path: Path,
                                                                            no_spark: None) -> None:
    there = tmp_path / "there.json"
    there.write_text('{"topic": "ORDERS", "body": "x", "deliver_at_ms": 1}\n')
    missing = tmp_path / "orders-2026-11.json"
    res = CliRunner().invoke(app, ["backfill", str(there), str(missing), "--data-dir", str(_data_dir(tmp_path))])
    refused(res, str(missing), "does not exist")
