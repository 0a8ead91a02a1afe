"""The data-directory commands at paths and files a user meets by mistake: one line saying what is
wrong (exit 2, as every input error of the CLI), never a traceback, and nothing written by the
commands that only read."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pytest
from typer.testing import CliRunner

from tests.timewheel.app._refusals import forbid_spark, refused
from storage import SegmentLayout
from tests.storage._meta_damage import NOW, stored
from timewheel.app.cli import app


# every command that takes --data-dir and can refuse it before doing anything else
_COMMANDS = [["init"], ["inspect"], ["inspect", "--verify"], ["find", "--id", "m1"], ["find", "--key", "k"],
             ["audit"], ["export", "--out", "out"], ["replay", "--since", "0", "--until", "1000", "--dry-run"],
             ["backfill", "in.json"]]


@pytest.fixture
def no_spark(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Spark commands must refuse these paths before a session starts."""
    forbid_spark(monkeypatch, "a data directory")



def _listing(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): (p.stat().st_size if p.is_file() else -1) for p in root.rglob("*")}


@pytest.mark.usefixtures("no_spark")
@pytest.mark.parametrize("cmd", _COMMANDS, ids=" ".join)
def test_a_data_dir_whose_name_the_filesystem_refuses_is_one_line(tmp_path: Path, cmd: list[str]) -> None:
    d = tmp_path / ("x" * 300)  # past NAME_MAX (255): every stat of it fails with ENAMETOOLONG
    res = CliRunner().invoke(app, [cmd[0], "--data-dir", str(d), *cmd[1:]])
    refused(res, "File name too long", "--data-dir")
    assert str(d) not in res.output, "a path too long for the filesystem is cut in the message"


def _mode_stops_reads(tmp_path: Path) -> bool:
    """Whether this user is kept out of a directory of mode 000 (root, with CAP_DAC_OVERRIDE, is not)."""
    probe = tmp_path / "probe"
    probe.mkdir(mode=0)
    try:
        os.listdir(probe)
        return False
    except PermissionError:
        return True
    finally:
        probe.chmod(0o755)


@pytest.mark.usefixtures("no_spark")
@pytest.mark.parametrize("cmd", _COMMANDS, ids=" ".join)
def test_a_data_dir_this_user_cannot_reach_is_one_line(tmp_path: Path, cmd: list[str]) -> None:
    if not _mode_stops_reads(tmp_path):
        pytest.skip("this user reads a directory whatever its mode (root): no way to make one unreadable")
    d = tmp_path / "locked" / "data"
    assert CliRunner().invoke(app, ["init", "--data-dir", str(d)]).exit_code == 0
    d.chmod(0)  # the directory itself
    try:
        res = CliRunner().invoke(app, [cmd[0], "--data-dir", str(d), *cmd[1:]])
        if cmd[0] in ("init", "inspect", "find"):  # their --data-dir is parsed by data_dir_option
            refused(res, "Permission denied", "--data-dir")
        else:  # refused while the option is parsed, in click's words
            assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
            assert res.exit_code == 2 and "is not readable" in res.output, res.output
    finally:
        d.chmod(0o755)
    d.parent.chmod(0)  # a directory above it: every look at the path fails with EACCES
    try:
        refused(CliRunner().invoke(app, [cmd[0], "--data-dir", str(d), *cmd[1:]]), "Permission denied")
    finally:
        d.parent.chmod(0o755)


# ---- files inside the data directory that cannot be read ------------------------------------------

def _stored(tmp_path: Path) -> tuple[Path, Path]:
    """A data directory holding three messages (one delivered) and its segment directory."""
    d = stored(tmp_path)
    layout = SegmentLayout.open_existing(d)
    return d, layout.segment_dir(layout.segment_start(NOW))


def _dispatch_log_a_directory(d: Path, seg: Path) -> Path:
    (seg / "dispatch.log").unlink()
    (seg / "dispatch.log").mkdir()
    return seg / "dispatch.log"


def _schedule_a_file(d: Path, seg: Path) -> Path:
    import shutil

    shutil.rmtree(d / "schedule")
    (d / "schedule").write_text("not a directory")
    return d / "schedule"


def _part_log_a_directory(d: Path, seg: Path) -> Path:
    (seg / "00000.log").unlink()
    (seg / "00000.log").mkdir()
    return seg / "00000.log"


def _dispatch_log_mode_000(d: Path, seg: Path) -> Path:
    if not _mode_stops_reads(d.parent):
        pytest.skip("this user reads a file whatever its mode (root): no way to make one unreadable")
    (seg / "dispatch.log").chmod(0)
    return seg / "dispatch.log"


@pytest.mark.parametrize("cmd", [["inspect"], ["inspect", "--verify", "--json"], ["find", "--key", "k"],
                                 ["find", "--id", "m0", "--json"]], ids=" ".join)
@pytest.mark.parametrize("damage", [_dispatch_log_a_directory, _schedule_a_file, _part_log_a_directory,
                                    _dispatch_log_mode_000],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_file_of_the_data_dir_that_cannot_be_read_is_named_in_one_line(
        tmp_path: Path, cmd: list[str], damage: Callable[[Path, Path], Path]) -> None:
    d, seg = _stored(tmp_path)
    bad = damage(d, seg)
    before = _listing(d)
    res = CliRunner().invoke(app, [cmd[0], "--data-dir", str(d), *cmd[1:]])
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    if cmd[0] == "inspect" and res.exit_code == 1:  # damage it found: named, the rest counted
        assert str(bad) in res.output.replace("\n", ""), res.output
    elif res.exit_code != 2:  # what cannot be read was not needed: an answer, not a traceback
        assert res.exit_code in (0, 1), res.output
    else:
        refused(res, str(bad))
    assert _listing(d) == before, "a command that reads changed the data directory"


@pytest.mark.parametrize("query", [["--id", "m0"], ["--key", "k", "--json"]], ids=" ".join)
@pytest.mark.parametrize("sub", ["schedule", "meta", "ingest"])
def test_find_names_a_directory_of_the_data_dir_that_is_a_file(tmp_path: Path, sub: str, query: list[str]) -> None:
    """Where the records, their ids or the records since the last checkpoint are kept cannot be
    read: the look-up says so, as it does for a file it cannot read, rather than answering that no
    message is stored (or that no engine stored anything yet), which sends the user elsewhere."""
    import shutil

    d, _ = _stored(tmp_path)
    shutil.rmtree(d / sub)
    (d / sub).write_text("not a directory")
    before = _listing(d)
    res = CliRunner().invoke(app, ["find", "--data-dir", str(d), *query])
    refused(res, str(d / sub), "Not a directory")
    assert _listing(d) == before


@pytest.mark.parametrize("given", ["", " "], ids=["empty", "blank"])
@pytest.mark.parametrize("cmd", [["init"], ["inspect"], ["inspect", "--verify"], ["find", "--id", "m0"],
                                 ["find", "--key", "k"], ["audit"], ["export", "--out", "x"], ["replay", "--dry-run"],
                                 ["backfill", "in.json"]], ids=" ".join)
def test_an_empty_data_dir_is_refused_never_taken_for_the_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cmd: list[str], given: str) -> None:
    """`--data-dir "$UNSET"` is refused as `serve` refuses it: `init` would make a data directory
    wherever it was run, and the others would read one that happens to be there."""
    if cmd[0] == "init":
        here = tmp_path / "empty"
        here.mkdir()
    else:
        here, _ = _stored(tmp_path)
    monkeypatch.chdir(here)
    before = _listing(here)
    res = CliRunner().invoke(app, [cmd[0], "--data-dir", given, *cmd[1:]])
    refused(res, f"--data-dir {given!r} is invalid: it must name a directory")
    assert _listing(here) == before


# ---- the Spark commands' stderr ------------------------------------------------------------------

class _Context:
    def setLogLevel(self, level: str) -> None:
        pass


class _Session:
    """Stands in for the SparkSession a command starts."""

    sparkContext = _Context()

    def stop(self) -> None:
        pass


@pytest.mark.parametrize("verbose", [False, True])
def test_the_spark_commands_start_spark_quiet_unless_verbose(monkeypatch: pytest.MonkeyPatch, verbose: bool) -> None:
    """Without --verbose, Spark's driver and executors start with the CLI's log4j2 settings (errors
    only): the path to them was resolved from the module's old place, found nothing, and every
    audit, replay, export and backfill printed Spark's default profile and warnings on stderr."""
    from pyspark.sql import SparkSession

    import spark.session
    from timewheel.app.cli_spark import _spark

    given: list[dict[str, str]] = []

    def get_session(master: str, app_name: str, conf: dict[str, str], **kwargs: object) -> _Session:
        given.append(dict(conf))
        return _Session()

    monkeypatch.setattr(spark.session, "get_session", get_session)
    # a session another test left active is reused as it is: this test is about the one a command starts
    monkeypatch.setattr(SparkSession, "getActiveSession", lambda: None)
    with _spark("local[1]", None, verbose):
        pass
    (conf,) = given
    if verbose:
        assert "spark.driver.extraJavaOptions" not in conf, conf
        return
    for side in ("driver", "executor"):
        option = conf.get(f"spark.{side}.extraJavaOptions", "")
        assert option.startswith("-Dlog4j2.configurationFile=file:"), conf
        settings = Path(option.split("file:", 1)[1])
        assert settings.is_file() and "rootLogger.level = error" in settings.read_text(), settings
