"""Replay's look at the dispatch logs it appends to, before it sends anything (no Spark session)."""
from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from spark.replay import check_dispatch_logs
from storage import DELIVERED, Record, ScheduleStore, StorageError, _dispatch_writer, dispatch_entries, read_dispatch_log
from storage.dispatch import encode_frame

NOW = 1_800_000_000_000 - 1_800_000_000_000 % 3_600_000 + 1_000


def _store_with_log(tmp_path: Path) -> tuple[Path, Path, int]:
    """A data directory with one segment whose dispatch log holds one whole frame; its path, the log's, the segment."""
    s = ScheduleStore(tmp_path / "d")
    s.append([Record(f"m{i}", "T", b"x", NOW + 1_000 + i) for i in range(3)], NOW)
    s.close()
    seg = s.layout.segment_start(NOW)
    log = s.layout.dispatch_log(seg)
    log.write_bytes(encode_frame(dispatch_entries(np.zeros(1, np.uint16), np.zeros(1, np.uint32),
                                                  np.full(1, NOW + 1_000, np.int64), NOW + 1_001, DELIVERED, 1), NOW))
    return tmp_path / "d", log, seg


def test_a_crashs_torn_frame_is_cut_and_said_so_before_replaying(tmp_path: Path) -> None:
    """Replay used to refuse ("start the engine on this data directory once"); it now cuts the
    tail as the engine would, and the replay's notes say which log lost how many torn bytes."""
    data, log, seg = _store_with_log(tmp_path)
    with open(log, "ab") as f:
        f.write(b"\x01" * 7)
    notes = check_dispatch_logs(str(data), seg, seg + 3_600_000)
    assert notes == [f"cut 7 bytes of a torn frame (a crash's, never a whole record) at the end of {log}"]
    read = read_dispatch_log(log)
    assert (read.torn_bytes, read.corrupt_frames, len(read.entries)) == (0, 0, 1)
    assert check_dispatch_logs(str(data), seg, seg + 3_600_000) == []  # whole now: nothing to say


def test_a_tail_another_writer_keeps_writing_without_a_lock_is_refused(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A tail that keeps changing under the lock is nobody's crash: it is not cut, and replay stops
    before sending, saying what writes there."""
    monkeypatch.setattr(_dispatch_writer, "LOCK_WAIT_S", 0.5)
    data, log, seg = _store_with_log(tmp_path)
    stop = threading.Event()

    def unlocked_writer() -> None:  # an engine of a build that takes no lock, mid-frame for a while
        while not stop.wait(0.01):
            with open(log, "ab") as f:
                f.write(b"\x01")

    writer = threading.Thread(target=unlocked_writer)
    writer.start()
    try:
        stop.wait(0.05)
        with pytest.raises(StorageError, match="still being written by a process that takes no lock"):
            check_dispatch_logs(str(data), seg, seg + 3_600_000)
    finally:
        stop.set()
        writer.join()
    read = read_dispatch_log(log)
    assert read.entries.size == 1 and read.torn_bytes >= 5  # nothing cut: the whole frame and the writer's bytes
