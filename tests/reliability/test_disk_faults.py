"""Disk faults under a running engine: torn tails, flipped bytes, a missing index, a full disk.

The engine reports each clearly, serves nothing corrupt, and keeps delivering everything else.
"""
from __future__ import annotations

import contextlib
import errno
from pathlib import Path


import numpy as np

from storage import MetaStoreStoppedError, SegmentLayout, StorageWriteError, check, read_index, summarize
from timewheel import Engine, EngineConfig, ManualClock, Message
from tests.timewheel.conftest import T0, RecordingSink, drive


def _engine(data: Path, clock: ManualClock, sink: RecordingSink) -> Engine:
    return Engine(EngineConfig(data), sink, clock, seed=0).start(background=False)


def _schedule(e: Engine, n: int, prefix: str = "m") -> list[str]:
    return e.schedule([Message("T", f"{prefix}{i}".encode(), T0 + 60_000 + i * 10, msg_id=f"{prefix}{i}")
                       for i in range(n)])


def _stored(data: Path, n: int) -> tuple[ManualClock, RecordingSink, list[str], SegmentLayout, int]:
    """An engine that stored `n` messages in one segment and stopped: (clock, sink, ids, layout, segment)."""
    clock = ManualClock(T0)
    sink = RecordingSink(clock)
    e = _engine(data, clock, sink)
    ids = _schedule(e, n)
    e.stop()
    layout = SegmentLayout.open_existing(data)
    return clock, sink, ids, layout, layout.list_segments()[0]


def test_flipped_bytes_are_never_served_and_the_rest_is_delivered(tmp_path: Path) -> None:
    clock, sink = ManualClock(T0), None
    sink = RecordingSink(clock)
    e = _engine(tmp_path / "d", clock, sink)
    ids = _schedule(e, 50)
    e.stop()
    layout = SegmentLayout.open_existing(tmp_path / "d")
    seg = layout.list_segments()[0]
    log = layout.part_log(seg, 0)
    raw = bytearray(log.read_bytes())
    raw[len(raw) // 2] ^= 0x5A  # inside some record's body
    log.write_bytes(bytes(raw))
    e = _engine(tmp_path / "d", clock, sink)
    drive(e, clock, T0 + 120_000)
    st = e.stats()
    e.stop()
    delivered = [m for m, _ in sink.sent]
    assert st.counters.corrupt == 1 and len(delivered) == 49
    assert set(delivered) < set(ids)
    [bad] = set(ids) - set(delivered)
    assert all(m.msg_id != bad for m in sink.messages)
    totals = summarize(layout)["totals"]
    assert isinstance(totals, dict) and (totals["dispatched"], totals["corrupt"], totals["pending"]) == (49, 1, 0)
    assert [f.kind for f in check(layout).findings] == ["corrupt_record"]


def test_torn_tail_and_missing_index_are_repaired_and_reported(tmp_path: Path) -> None:
    clock, sink, ids, layout, seg = _stored(tmp_path / "d", 30)
    with open(layout.part_log(seg, 0), "ab") as f:
        f.write(b"\xa7\x01\x00\x00\xff\xff")  # a record that never finished
    layout.part_index(seg, 0).unlink()
    e = _engine(tmp_path / "d", clock, sink)
    rep = e.store.recovery  # type: ignore[union-attr]
    assert rep.index_entries_added == 30 and rep.log_bytes_cut == 6
    assert any("repaired" in f for f in rep.findings)
    drive(e, clock, T0 + 120_000)
    e.stop()
    assert sorted(m for m, _ in sink.sent) == sorted(ids)
    assert check(layout).ok


def test_full_disk_refuses_cleanly_and_recovers_when_space_returns(small_disk: Path) -> None:
    """Refused writes keep nothing; once space is freed everything acknowledged is delivered. Where the
    disk filled under a write of RocksDB's (its log, a flush) and not only under the engine's files,
    RocksDB takes no write until reopened: that store says so (`MetaStoreStoppedError`) and a restart
    recovers (each run meets one or the other, as the bytes fall)."""
    clock = ManualClock(T0)
    sink = RecordingSink(clock)
    data = small_disk / "data"
    reserve = small_disk / "reserve"
    reserve.write_bytes(b"\0" * 400_000)  # what the operator frees once the disk is full
    e = _engine(data, clock, sink)
    accepted: list[str] = []
    refusals = 0
    big = b"z" * 20_000
    for i in range(400):
        try:
            accepted += e.schedule([Message("T", big, T0 + 60_000 + i, msg_id=f"big{i}")])
        except StorageWriteError as err:
            refusals += 1
            assert err.errno in (None, errno.ENOSPC) or "No space" in str(err)
            assert "nothing of this batch was kept" in str(err) or isinstance(err, MetaStoreStoppedError), err
            if refusals >= 3:
                break
    assert refusals >= 1 and accepted, "the disk never filled, or nothing fitted"
    assert [p for p in data.rglob("*.wal")]
    reserve.unlink()  # space comes back
    try:
        e.store.checkpoint()  # type: ignore[union-attr]
    except MetaStoreStoppedError:
        with contextlib.suppress(MetaStoreStoppedError):  # its last checkpoint cannot flush either
            e.stop()
        e = _engine(data, clock, sink)  # the restart the error asks for
    # everything acknowledged before is still there and is delivered
    drive(e, clock, T0 + 120_000)
    e.stop()
    assert set(accepted) <= {m for m, _ in sink.sent}
    assert not [f for f in check(SegmentLayout.open_existing(data)).findings if f.kind != "unknown_file"]


def test_index_due_time_never_serves_a_record_before_its_own(tmp_path: Path) -> None:
    clock = ManualClock(T0)
    sink = RecordingSink(clock)
    e = _engine(tmp_path / "d", clock, sink)
    ids = _schedule(e, 5)
    [late] = e.schedule([Message("T", b"late", T0 + 700_000, msg_id="late")])
    e.stop()
    layout = SegmentLayout.open_existing(tmp_path / "d")
    seg = layout.list_segments()[0]
    idx_path = layout.part_index(seg, 0)
    idx = read_index(idx_path)
    idx["due_ms"][-1] = T0 + 95_000  # the index says 605 s earlier than the record
    idx.tofile(idx_path)
    e = _engine(tmp_path / "d", clock, sink)
    drive(e, clock, T0 + 800_000)
    st = e.stats()
    e.stop()
    assert [at for m, at in sink.sent if m == late and at < T0 + 700_000] == []
    assert sorted(m for m, _ in sink.sent if m != late) == sorted(ids)
    # the record itself is intact: it is sent once, at its own due time, not marked corrupt for good
    assert [at for m, at in sink.sent if m == late] == [T0 + 700_000]
    assert st.counters.corrupt == 0
    [finding] = check(layout).findings
    assert finding.kind == "corrupt_record" and "index says" in finding.detail


def test_index_offset_past_the_part_is_reported_and_repaired(tmp_path: Path) -> None:
    clock, sink, ids, layout, seg = _stored(tmp_path / "d", 10)
    idx_path = layout.part_index(seg, 0)
    idx = read_index(idx_path)
    idx["offset"][3] = 0x7FFF0000  # a flipped high bit: past the end of the part
    idx.tofile(idx_path)
    found = check(layout).findings
    assert [f.kind for f in found] == ["bad_index"], found
    e = _engine(tmp_path / "d", clock, sink)  # recovery rebuilds the index from the CRC-checked records
    drive(e, clock, T0 + 120_000)
    st = e.stats()
    e.stop()
    assert sorted(m for m, _ in sink.sent) == sorted(ids) and st.counters.corrupt == 0
    totals = summarize(layout)["totals"]
    assert check(layout).ok and isinstance(totals, dict) and totals["dispatched"] == 10


def test_a_damaged_record_in_an_unindexed_part_cuts_nothing_after_it(tmp_path: Path) -> None:
    clock, sink, ids, layout, seg = _stored(tmp_path / "d", 10)
    idx = read_index(layout.part_index(seg, 0))
    layout.part_index(seg, 0).unlink()  # recovery rebuilds it by scanning the records
    log = layout.part_log(seg, 0)
    raw = bytearray(log.read_bytes())
    raw[int(idx["offset"][3] + idx["length"][3]) - 1] ^= 0x01  # the last byte of the fourth record's body
    log.write_bytes(bytes(raw))
    e = _engine(tmp_path / "d", clock, sink)
    drive(e, clock, T0 + 120_000)
    st = e.stats()
    e.stop()
    assert sorted(m for m, _ in sink.sent) == sorted(ids[:3] + ids[4:]) and st.counters.corrupt == 1
    assert log.stat().st_size == len(raw)
    assert [f.kind for f in check(layout).findings] == ["corrupt_record"]
