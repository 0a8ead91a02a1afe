"""A writer killed with SIGKILL at random moments loses nothing it acknowledged."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from storage import FlushPolicy, ScheduleStore, check

WRITER = [sys.executable, "-m", "tests.storage._crash_writer"]
ROOT = Path(__file__).resolve().parents[2]


def _run_and_kill(data_dir: Path, flush: str, round_no: int, rng: random.Random) -> set[str]:
    proc = subprocess.Popen([*WRITER, str(data_dir), flush, str(round_no)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    acked: set[str] = set()
    assert proc.stdout is not None
    ready = proc.stdout.readline()
    assert ready.strip() == "ready", proc.stderr.read() if proc.stderr else ready
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout))  # type: ignore[arg-type]
    reader.start()
    time.sleep(rng.uniform(0.02, 0.6))
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    reader.join()
    for line in lines:
        if line.endswith("\n"):  # a line cut by the kill was not fully printed: its batch still counts
            acked.update(line.split())
    proc.stderr.close()  # type: ignore[union-attr]
    return acked


@pytest.mark.slow
@pytest.mark.parametrize("flush", ["async", "sync"])
def test_sigkill_twenty_times_loses_no_acknowledged_record(tmp_path: Path, flush: FlushPolicy) -> None:
    rng = random.Random(flush)
    data_dir = tmp_path / "data"
    acked: set[str] = set()
    for round_no in range(20):
        acked |= _run_and_kill(data_dir, flush, round_no, rng)
    assert len(acked) > 1000, "the writer barely ran; the test would prove nothing"
    with ScheduleStore(data_dir, flush=flush) as store:
        found = store.meta.locations(sorted(acked))
        missing = [m for m, loc in zip(sorted(acked), found) if loc is None]
        assert not missing, f"{len(missing)} acknowledged records lost, e.g. {missing[:5]}"
        for msg_id, loc in zip(sorted(acked), found):
            assert loc is not None
            assert store.read_record(loc.segment_ms, loc.part, loc.offset).msg_id == msg_id
        total = sum(len(store.segment_index(s)) for s in store.layout.list_segments())
        assert total >= len(acked)
        layout = store.layout
    report = check(layout)
    assert report.ok, report.findings[:5]
