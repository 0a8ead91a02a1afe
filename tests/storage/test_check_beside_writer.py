"""`check(fix=True)` beside a writer appending to a part: a commit in flight is never cut nor indexed twice."""
from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import storage._writer as writer_module
from storage import Record, ScheduleStore, SegmentLayout, check
from storage.index import index_entries, read_index
from storage.record import decode, encode

NOW = 1_800_000_000_000  # 2027-01-15T08:00:00Z


def recs(n: int, prefix: str, start: int = NOW) -> list[Record]:
    return [Record(f"{prefix}{i}", "ORDERS", f"body-{i}".encode() * 20, start + i * 1000) for i in range(n)]


def assert_whole(layout: SegmentLayout, seg: int, ids: list[str]) -> None:
    """Part 0's index tiles its log and names every record written, each once, in order, readable."""
    idx = read_index(layout.part_index(seg, 0))
    data = layout.part_log(seg, 0).read_bytes()
    ends = (idx["offset"].astype(np.int64) + idx["length"]).tolist()
    assert idx["offset"].tolist() == [0] + ends[:-1], f"the index no longer tiles the log: {idx.tolist()}"
    assert ends[-1] == len(data), f"the log holds {len(data)} bytes, its index {ends[-1]}"
    assert [decode(data, int(o), due_ms=int(d))[0].msg_id for o, d in zip(idx["offset"], idx["due_ms"])] == ids


class PausedCommit:
    """Stops the engine's part writer, once armed, after the first `cut` bytes of its next commit's
    records (all of them when None) until `go_on` is set: a commit caught between its writes."""

    def __init__(self) -> None:
        self.armed = False
        self.cut: int | None = None
        self.stopped = threading.Event()
        self.go_on = threading.Event()

    def wrap(self, real: Any) -> Any:
        def write_all(fd: int, data: bytes | memoryview) -> None:
            if not self.armed or self.stopped.is_set():
                real(fd, data)
                return
            at = len(data) if self.cut is None else self.cut
            real(fd, memoryview(data)[:at])
            self.stopped.set()
            assert self.go_on.wait(30)
            real(fd, memoryview(data)[at:])
        return write_all


@pytest.fixture
def paused(monkeypatch: pytest.MonkeyPatch) -> Iterator[PausedCommit]:
    p = PausedCommit()
    monkeypatch.setattr(writer_module, "write_all", p.wrap(writer_module.write_all))
    yield p
    p.go_on.set()  # a failed test leaves no writer waiting


@pytest.mark.parametrize("cut", [None, 30], ids=["records-not-yet-indexed", "record-half-written"])
def test_check_fix_leaves_a_commit_the_engine_is_writing_to_the_engine(
        tmp_path: Path, paused: PausedCommit, cut: int | None) -> None:
    """The engine's writer has written a commit's records (or the first bytes of one) and not yet
    their index entries when `check(fix=True)` reads the part. Check once indexed those records
    itself (the engine then indexed them again: the index no longer tiled the log), or cut the
    half-written one (the engine's write went on past the cut, its records at other offsets than
    their index entries say). Now the part is the engine's while it has it open: check counts its
    tail as in flight and leaves it be."""
    s = ScheduleStore(tmp_path / "d")
    try:
        seg = s.layout.segment_start(NOW)
        s.append(recs(3, "a"), NOW + 1)
        paused.armed, paused.cut = True, cut
        failed: list[BaseException] = []

        def commit() -> None:
            try:
                s.append(recs(2, "b", NOW + 100_000), NOW)
            except BaseException as e:  # seen by the test, not lost in the thread
                failed.append(e)

        engine = threading.Thread(target=commit)
        engine.start()
        assert paused.stopped.wait(10)
        rep = check(s.layout, fix=True, now_ms=NOW)
        paused.go_on.set()
        engine.join(10)
        assert not engine.is_alive() and failed == []
        assert_whole(s.layout, seg, ["a0", "a1", "a2", "b0", "b1"])
        assert (rep.tails_in_flight, rep.fixed, rep.findings) == (1, 0, [])
    finally:
        s.close()
    assert check(SegmentLayout.open_existing(tmp_path / "d")).ok


def _flocked(path: Path) -> bool:
    """Whether some descriptor holds a `flock` of `path` (read from /proc/locks: asking by taking the
    lock would hold it for a moment, and a check trying it then would take the part as the engine's)."""
    ino = os.stat(path).st_ino
    with open("/proc/locks") as f:
        return any(line.split()[1] == "FLOCK" and int(line.split()[5].rsplit(":", 1)[1]) == ino for line in f)


def test_check_fix_repairs_a_tail_written_without_the_lock_only_once_it_stands_still(tmp_path: Path) -> None:
    """A writer that takes no lock on the part (an older build; a filesystem without `flock`) has
    written a record and not yet its index entry when check reads the part, and writes the entry
    while check holds the part's lock and watches its tail. Check once indexed the record at once,
    and the part ended with two entries for it. Now a tail that moves is left to its writer."""
    s = ScheduleStore(tmp_path / "d")
    s.append(recs(3, "a"), NOW + 1)
    s.close()
    seg = s.layout.segment_start(NOW)
    log_path, idx_path = s.layout.part_log(seg, 0), s.layout.part_index(seg, 0)
    late = recs(1, "b", NOW + 100_000)[0]
    blob = encode(late, NOW)
    offset = os.path.getsize(log_path)
    with open(log_path, "ab") as f:
        f.write(blob)  # the record, its index entry not yet
    result: list[Any] = []
    checker = threading.Thread(target=lambda: result.append(check(s.layout, fix=True, now_ms=NOW)))
    checker.start()
    watching = False
    while checker.is_alive() and not watching:  # until check watches the tail under the lock
        watching = _flocked(log_path)
        threading.Event().wait(0.001)
    with open(idx_path, "ab") as f:  # the writer goes on: the record's index entry
        f.write(index_entries([late.due_ms], [offset], [len(blob)]).tobytes())
    checker.join(30)
    [rep] = result
    assert_whole(s.layout, seg, ["a0", "a1", "a2", "b0"])
    assert (rep.tails_in_flight, rep.fixed, rep.findings) == (1, 0, []) and watching


def test_check_fix_repairs_a_tail_no_writer_holds_once_it_stands_still(tmp_path: Path) -> None:
    """What no writer is finishing (a crash's torn record) is still cut, and the records before it
    indexed, once the part stands still."""
    s = ScheduleStore(tmp_path / "d")
    s.append(recs(3, "a"), NOW + 1)
    s.close()
    seg = s.layout.segment_start(NOW)
    log_path, idx_path = s.layout.part_log(seg, 0), s.layout.part_index(seg, 0)
    late = recs(2, "b", NOW + 100_000)
    with open(log_path, "ab") as f:
        f.write(encode(late[0], NOW) + encode(late[1], NOW)[:30])  # a whole record unindexed, then a torn one
    rep = check(s.layout, fix=True, now_ms=NOW)
    assert [f.kind for f in rep.findings] == ["tail_mismatch"] and (rep.fixed, rep.tails_in_flight) == (1, 0)
    assert_whole(s.layout, seg, ["a0", "a1", "a2", "b0"])
    assert len(read_index(idx_path)) == 4
