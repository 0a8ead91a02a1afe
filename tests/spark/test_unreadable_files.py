"""The Spark jobs on a data directory holding a file they cannot read (a directory where a part's
log, its index or a dispatch log belongs; `schedule/` a file): one line naming it, exit 2 as every
command that cannot use its data directory, never a Python worker's traceback, and nothing
written, neither into the data directory nor a partial output."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Callable, NoReturn

import pytest
import typer
from typer.testing import CliRunner

from spark.audit import run_audit
from spark.export import export
from spark.replay import replay
from storage import DELIVERED, ScheduleStore
from tests.spark.conftest import HOUR, T0, deliver, records

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.spark


def _stored(tmp_path: Path, name: str = "data") -> tuple[Path, Path]:
    """A data directory of two segments (the first delivered) and the first segment's directory."""
    d = tmp_path / name
    with ScheduleStore(d) as store:
        store.append(records(4, step=60_000) + records(2, prefix="b", start=T0 + HOUR, step=60_000), T0 - 1000)
        deliver(store, T0, slice(0, 4), DELIVERED, T0 + 5_000)
        store.checkpoint()
        return d, store.layout.segment_dir(T0)


def _a_directory(name: str) -> Callable[[Path, Path], Path]:
    """Damage: the file `name` of the segment replaced by a directory."""
    def damage(d: Path, seg: Path) -> Path:
        (seg / name).unlink()
        (seg / name).mkdir()
        return seg / name

    damage.__name__ = f"{name}_a_directory"
    return damage


def _schedule_a_file(d: Path, seg: Path) -> Path:
    shutil.rmtree(d / "schedule")
    (d / "schedule").write_text("not a directory")
    return d / "schedule"


_LOG, _INDEX, _DISPATCH = _a_directory("00000.log"), _a_directory("00000.idx"), _a_directory("dispatch.log")
# what each job reads: a replay sends from and records into the dispatch logs, a dry run reads none,
# a backfill reads the ids of the records only
_REFUSED = [(job, damage) for job in ("audit", "export", "replay-send") for damage in (_LOG, _INDEX, _DISPATCH)] \
    + [(job, damage) for job in ("replay", "backfill") for damage in (_LOG, _INDEX)] \
    + [(job, _schedule_a_file) for job in ("audit", "export", "replay", "replay-send", "backfill")]


def _listing(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): (p.stat().st_size if p.is_file() else -1) for p in root.rglob("*")}


def _cli() -> typer.Typer:
    from timewheel.app.cli_spark import register

    app = typer.Typer()
    app.callback()(lambda: None)
    register(app)
    return app


def _command(name: str, d: Path, tmp_path: Path) -> list[str]:
    if name == "audit":
        return ["audit", "--data-dir", str(d), "--now", str(T0 + 3 * HOUR), "--out", str(tmp_path / "out")]
    if name == "export":
        return ["export", "--data-dir", str(d), "--out", str(tmp_path / "out")]
    if name.startswith("replay"):  # nothing listens on port 1: a message sent would fail
        how = ["--namesrv", "127.0.0.1:1", "--rate", "0"] if name == "replay-send" else ["--dry-run"]
        return ["replay", "--data-dir", str(d), "--since", str(T0), "--until", str(T0 + 2 * HOUR), *how]
    rows = tmp_path / "in.json"
    rows.write_text(json.dumps({"topic": "ORDERS", "body": "x", "deliver_at_ms": T0 + 2 * HOUR}) + "\n")
    return ["backfill", str(rows), "--data-dir", str(d), "--rejects", str(tmp_path / "out")]


@pytest.mark.parametrize(("job", "damage"), _REFUSED, ids=[f"{j}-{d.__name__.strip('_')}" for j, d in _REFUSED])
def test_a_file_the_job_cannot_read_is_named_in_one_line(spark: SparkSession, tmp_path: Path, job: str,
                                                         damage: Callable[[Path, Path], Path]) -> None:
    d, seg = _stored(tmp_path)
    bad = damage(d, seg)
    before = _listing(d)
    res = CliRunner().invoke(_cli(), _command(job, d, tmp_path))
    assert res.exception is None or isinstance(res.exception, SystemExit), str(res.exception)[:2000]
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"timewheel: cannot read {bad} in the data directory"), res.output
    assert _listing(d) == before, "the job changed the data directory it refused"
    assert not (tmp_path / "out").exists(), "the job wrote output for a data directory it refused"


@pytest.mark.parametrize("job", ["replay", "backfill"])
def test_a_dispatch_log_the_job_does_not_read_stops_nothing(spark: SparkSession, tmp_path: Path, job: str) -> None:
    d, seg = _stored(tmp_path)
    _DISPATCH(d, seg)
    res = CliRunner().invoke(_cli(), _command(job, d, tmp_path))
    assert res.exit_code == 0, res.output


def _no_sender() -> NoReturn:
    raise AssertionError("a sender was made for a data directory the replay refuses")


def test_the_jobs_raise_a_typed_error_naming_the_file(spark: SparkSession, tmp_path: Path) -> None:
    """Called from a program: the error names the file and carries the reason, before any job runs."""
    from spark._util import UnreadableDataError

    d, seg = _stored(tmp_path)
    bad = _a_directory("00000.log")(d, seg)
    with pytest.raises(UnreadableDataError) as audit_error:
        run_audit(spark, d, now_ms=T0 + 3 * HOUR, out_dir=tmp_path / "audit")
    with pytest.raises(UnreadableDataError) as export_error:
        export(spark, d, tmp_path / "export")
    for e in (audit_error.value, export_error.value):
        assert e.filename == str(bad) and e.strerror == "Is a directory"
        assert str(bad) in str(e)
    assert not (tmp_path / "audit").exists() and not (tmp_path / "export").exists()
    d, seg = _stored(tmp_path, "other")
    log = _DISPATCH(d, seg)  # a replay records what it sent there: refused before a sender is made
    with pytest.raises(UnreadableDataError) as replay_error:
        replay(spark, d, since_ms=T0, until_ms=T0 + HOUR, sender_factory=_no_sender)
    assert replay_error.value.filename == str(log)
