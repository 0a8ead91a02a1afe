"""Ctrl-C during a Spark command, as a terminal sends it (SIGINT to the command's process group):
the command stops, says in one line what was left undone, exits 130, and leaves no JVM running;
whenever the signal comes, while the driver JVM starts or while a job runs."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from storage import Record, ScheduleStore
from tests.polling import wait_for
from tests.ports import free_port

pytestmark = pytest.mark.spark

ROOT = Path(__file__).resolve().parents[3]
NOW = 1_795_460_400_000  # 2026-11-23 19:00 UTC


def _group(pgid: int) -> list[tuple[int, str]]:
    """The live processes of a process group: (pid, command name)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        name, rest = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
        if int(rest[2]) == pgid and rest[0] != "Z":
            found.append((int(stat.parent.name), name))
    return found


def _job_started(port: int) -> bool:
    """Whether the Spark UI on `port` lists a job of the command's application."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/applications", timeout=1) as r:
            apps = json.loads(r.read())
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/applications/{apps[0]['id']}/jobs",
                                    timeout=1) as r:
            return bool(json.loads(r.read()))
    except (OSError, ValueError, LookupError):
        return False


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data directory of 200,000 records, enough for the audit's scan to run a while."""
    data = tmp_path_factory.mktemp("interrupt") / "data"
    with ScheduleStore(data) as store:
        store.append([Record(f"m{i}", "ORDERS", b"x" * 20, NOW + 5_000 + i) for i in range(200_000)], NOW)
    return data


@pytest.fixture
def command(data_dir: Path, tmp_path: Path) -> tuple[list[str], int]:
    """`timewheel audit` of that directory, with its Spark UI on a port of its own."""
    port = free_port()
    argv = [sys.executable, "-m", "timewheel", "audit", "--data-dir", str(data_dir), "--now", str(NOW),
            "--out", str(tmp_path / "audit"), "--master", "local[1]", "--conf", f"spark.ui.port={port}"]
    return argv, port


def _interrupt(argv: list[str], ready: Callable[[int], bool], tmp_path: Path) -> tuple[int, str, str, int]:
    """Run the command in a process group of its own, SIGINT the group once `ready(pgid)` holds;
    its exit code, stdout, stderr and group."""
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=o, stderr=e, start_new_session=True)
    try:
        assert wait_for(lambda: ready(proc.pid) or proc.poll() is not None, 300)
        assert proc.poll() is None, err.read_text()
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return code, out.read_text(), err.read_text(), proc.pid


def _check_interrupted(code: int, out: str, err: str, pgid: int,
                       undone: str = "timewheel: interrupted: the audit did not finish") -> None:
    try:
        assert code == 130, err
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
        last = (err.strip().splitlines() or [""])[-1]
        assert last.startswith(undone), err
        assert "ok" not in out.split(), out
        # the JVM exits once the command's end closes its stdin: wait for that, never for a fixed time
        assert wait_for(lambda: not _group(pgid), 60), _group(pgid)
    finally:
        for pid, _ in _group(pgid):
            os.kill(pid, signal.SIGKILL)


def test_ctrl_c_while_the_driver_jvm_starts_stops_the_audit(command: tuple[list[str], int], tmp_path: Path) -> None:
    argv, _ = command
    code, out, err, pgid = _interrupt(argv, lambda pgid: any(name == "java" for _, name in _group(pgid)), tmp_path)
    _check_interrupted(code, out, err, pgid)


def test_ctrl_c_while_a_job_runs_stops_the_audit(command: tuple[list[str], int], tmp_path: Path) -> None:
    argv, port = command
    code, out, err, pgid = _interrupt(argv, lambda pgid: _job_started(port), tmp_path)
    _check_interrupted(code, out, err, pgid)


@pytest.fixture(scope="module")
def backfill_input(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """200,000 rows of JSON lines for a backfill, enough for its job to run a while."""
    path = tmp_path_factory.mktemp("interrupt-backfill") / "rows.jsonl"
    with open(path, "w") as f:
        for i in range(200_000):
            f.write(json.dumps({"topic": "ORDERS", "body": f"b{i}", "deliver_at_ms": NOW + 3_600_000 + i,
                                "msg_id": f"bf{i}"}) + "\n")
    return path


@pytest.mark.parametrize("name", ["export", "replay --dry-run", "backfill"])
def test_ctrl_c_while_a_job_runs_stops_each_other_spark_command(name: str, data_dir: Path, backfill_input: Path,
                                                                tmp_path: Path) -> None:
    """The commands that share the audit's wrapper: each stops with what it left undone."""
    port = free_port()
    spark = ["--master", "local[1]", "--conf", f"spark.ui.port={port}"]
    with ScheduleStore(tmp_path / "fresh"):  # a backfill's target: an engine's data directory
        pass
    args, undone = {
        "export": (["export", "--data-dir", str(data_dir), "--out", str(tmp_path / "export")],
                   "the export did not finish"),
        "replay --dry-run": (["replay", "--data-dir", str(data_dir), "--since", str(NOW), "--until",
                              str(NOW + 3_600_000), "--dry-run"], "the dry run did not finish; nothing was sent"),
        "backfill": (["backfill", str(backfill_input), "--data-dir", str(tmp_path / "fresh"), "--format", "json"],
                     "no part of this backfill was published unless it had finished"),
    }[name]
    argv = [sys.executable, "-m", "timewheel", *args, *spark]
    code, out, err, pgid = _interrupt(argv, lambda pgid: _job_started(port), tmp_path)
    _check_interrupted(code, out, err, pgid, f"timewheel: interrupted: {undone}")
