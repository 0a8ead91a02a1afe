"""The schedule store: appends, dedup, group commit, recovery, dispatch log, retention, check."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

import storage._checkpoints as checkpoints_module
import storage._reader as reader_module
import storage.meta as meta_module
import storage.retention as retention_module

from storage import (CANCELLED, DEAD_LETTERED, DELIVERED, CorruptRecordError, DelayTooLongError, MetaStoreCorruptError,
                     Record, ScheduleStore, SegmentLayout, StorageError, StorageWriteError, check, dispatch_entries,
                     read_dispatch_log, summarize, summarize_segment)
from tests.storage._meta_damage import damage_one_document, stored

NOW = 1_800_000_000_000  # 2027-01-15T08:00:00Z
HOUR = 3_600_000


def crash(s: ScheduleStore) -> None:
    """Drop a store as a killed process would: no checkpoint, no flush."""
    s._wal.close()
    s.writer.close()
    s.meta._db.close()


def recs(n: int, prefix: str = "m", start: int = NOW, step: int = 1000, **kw: Any) -> list[Record]:
    return [Record(f"{prefix}{i}", "ORDERS", f"body-{i}".encode(), start + i * step, **kw) for i in range(n)]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[ScheduleStore]:
    s = ScheduleStore(tmp_path / "data")
    yield s
    s.close()


def test_append_and_read_back(store: ScheduleStore) -> None:
    r = store.append(recs(10, keys=("order-1",), properties={"p": "v"}, tags="t"), NOW)
    assert r.new.all()
    seg = store.layout.segment_start(NOW)
    idx = store.segment_index(seg)
    assert len(idx) == 10
    back = store.read_record(seg, int(idx.part[3]), int(idx.offset[3]))
    assert back.msg_id == "m3" and back.body == b"body-3" and back.keys == ("order-1",)
    assert back.properties == {"p": "v"} and back.tags == "t" and back.enqueue_ms == NOW
    assert sorted(store.meta.ids_for_key("order-1")) == sorted(f"m{i}" for i in range(10))


def test_repeated_ids_are_stored_once(store: ScheduleStore) -> None:
    store.append(recs(5), NOW)
    again = store.append(recs(5) + recs(2, prefix="n") + recs(2, prefix="n"), NOW)
    assert again.new.tolist() == [False] * 5 + [True, True, False, False]
    assert len(store.segment_index(store.layout.segment_start(NOW))) == 7
    # a duplicate reports where the first copy lives
    assert again.locations["offset"][7] == again.locations["offset"][5]


def test_batch_spanning_segments_is_one_ingest_frame(store: ScheduleStore) -> None:
    before = store._wal.position
    store.append(recs(48, step=HOUR), NOW)
    frames = list(store._wal.frames(store._wal.seq, before))
    assert len(frames) == 1 and len(frames[0].locations) == 48
    assert len(store.layout.list_segments()) == 48


def test_listing_segments_between_times_keeps_each_hour_that_overlaps(store: ScheduleStore) -> None:
    store.append(recs(6, step=HOUR), NOW)
    segs = store.layout.list_segments()
    assert store.layout.list_segments(segs[1] + 1, segs[3]) == segs[1:3]  # [since, until): the hour at until is out
    assert store.layout.list_segments(segs[1] + HOUR, None) == segs[2:]  # an hour ending at since is out
    assert store.layout.list_segments(None, segs[0] + 1) == segs[:1]


def test_delay_past_maximum_is_refused_whole(tmp_path: Path) -> None:
    with ScheduleStore(tmp_path / "d", max_delay_ms=10 * HOUR) as s:
        with pytest.raises(DelayTooLongError, match="maximum delay"):
            s.append(recs(1) + [Record("late", "T", b"", NOW + 11 * HOUR)], NOW)
        assert s.layout.list_segments() == []


def test_concurrent_appends_group_commit(tmp_path: Path) -> None:
    with ScheduleStore(tmp_path / "d", flush="sync") as s:
        def worker(w: int) -> None:
            for b in range(20):
                s.append(recs(10, prefix=f"w{w}-{b}-"), NOW)

        threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(s.segment_index(s.layout.segment_start(NOW))) == 8 * 20 * 10
        frames = list(s._wal.frames(s._wal.seq, 0))
    assert sum(len(f.locations) for f in frames) == 1600
    assert len(frames) < 160  # concurrent callers shared commits


def test_segment_minutes_must_match(tmp_path: Path) -> None:
    ScheduleStore(tmp_path / "d", segment_minutes=30).close()
    with pytest.raises(StorageError, match="segment_minutes=30"):
        ScheduleStore(tmp_path / "d", segment_minutes=60)


def test_recovery_replays_ingest_log_after_lost_part_writes(tmp_path: Path) -> None:
    s = ScheduleStore(tmp_path / "d")
    s.append(recs(100), NOW)
    seg = s.layout.segment_start(NOW)
    log, idx = s.layout.part_log(seg, 0), s.layout.part_index(seg, 0)
    crash(s)
    os.truncate(log, 500)  # the part lost its tail, the ingest log still has the frame
    os.truncate(idx, 0)
    s2 = ScheduleStore(tmp_path / "d")
    assert s2.recovery.replayed_records == 100
    ix = s2.segment_index(seg)
    assert len(ix) == 100
    assert s2.read_record(seg, 0, int(ix.offset[99])).msg_id == "m99"
    assert check(s2.layout).ok
    s2.close()


def test_torn_part_tail_without_ingest_log_is_cut_and_reported(tmp_path: Path) -> None:
    s = ScheduleStore(tmp_path / "d")
    s.append(recs(10), NOW)
    s.close()  # checkpointed: the ingest log no longer covers these records
    seg = s.layout.segment_start(NOW)
    log = s.layout.part_log(seg, 0)
    with open(log, "ab") as f:
        f.write(b"\xa7\x01\x00\x00garbage")
    s2 = ScheduleStore(tmp_path / "d")
    assert s2.recovery.log_bytes_cut == 11
    assert any("repaired" in f for f in s2.recovery.findings)
    assert len(s2.segment_index(seg)) == 10
    s2.close()


def test_missing_index_is_rebuilt(tmp_path: Path) -> None:
    s = ScheduleStore(tmp_path / "d")
    s.append(recs(25), NOW)
    s.close()
    seg = s.layout.segment_start(NOW)
    s.layout.part_index(seg, 0).unlink()
    assert any(f.kind == "missing_index" for f in check(SegmentLayout.open_existing(tmp_path / "d")).findings)
    s2 = ScheduleStore(tmp_path / "d")
    assert s2.recovery.index_entries_added == 25
    assert len(s2.segment_index(seg)) == 25
    s2.close()


def test_flipped_byte_is_detected_and_never_served(tmp_path: Path) -> None:
    s = ScheduleStore(tmp_path / "d")
    s.append(recs(5), NOW)
    seg = s.layout.segment_start(NOW)
    ix = s.segment_index(seg)
    s.close()
    log = s.layout.part_log(seg, 0)
    data = bytearray(log.read_bytes())
    data[int(ix.offset[2]) + 50] ^= 0xFF
    log.write_bytes(bytes(data))
    s2 = ScheduleStore(tmp_path / "d")
    with pytest.raises(CorruptRecordError, match="CRC32C"):
        s2.read_record(seg, 0, int(ix.offset[2]))
    assert s2.read_record(seg, 0, int(ix.offset[3])).msg_id == "m3"
    assert s2.corrupt_records_found == 1
    s2.close()
    rep = check(s2.layout)
    assert [f.kind for f in rep.findings] == ["corrupt_record"]
    fixed = check(s2.layout, fix=True, now_ms=NOW)
    assert fixed.fixed == 1
    totals = summarize(s2.layout)["totals"]
    assert isinstance(totals, dict) and totals["corrupt"] == 1


def test_dispatch_log_round_trip_and_torn_tail(store: ScheduleStore) -> None:
    store.append(recs(4), NOW)
    seg = store.layout.segment_start(NOW)
    ix = store.segment_index(seg)
    store.record_dispatch(seg, dispatch_entries(ix.part[:2], ix.offset[:2], ix.due_ms[:2], NOW + 5, DELIVERED, 1), NOW)
    path = store.layout.dispatch_log(seg)
    with open(path, "ab") as f:
        f.write(b"\x01" * 30)  # a torn frame
    read = read_dispatch_log(path)
    assert len(read.entries) == 2 and read.torn_bytes == 30
    store.release_segment(seg)
    store.dispatch_writer.forget(seg)  # reopen as after a restart: the torn frame is cut before appending
    store.record_dispatch(seg, dispatch_entries(ix.part[2:3], ix.offset[2:3], ix.due_ms[2:3], NOW, CANCELLED, 0), NOW)
    read = read_dispatch_log(path)
    assert read.torn_bytes == 0 and read.entries["outcome"].tolist() == [DELIVERED, DELIVERED, CANCELLED]


def test_inspect_json_reports_exactly_what_was_written(tmp_path: Path) -> None:
    s = ScheduleStore(tmp_path / "d")
    s.append(recs(30, step=HOUR // 10), NOW)  # 10 per segment over 3 segments
    seg0 = s.layout.segment_start(NOW)
    ix = s.segment_index(seg0)
    s.record_dispatch(seg0, dispatch_entries(ix.part[:4], ix.offset[:4], ix.due_ms[:4], NOW, DELIVERED), NOW)
    s.record_dispatch(seg0, dispatch_entries(ix.part[:1], ix.offset[:1], ix.due_ms[:1], NOW, DELIVERED), NOW)
    s.record_dispatch(seg0, dispatch_entries(ix.part[4:6], ix.offset[4:6], ix.due_ms[4:6], NOW, CANCELLED), NOW)
    s.record_dispatch(seg0, dispatch_entries(ix.part[6:7], ix.offset[6:7], ix.due_ms[6:7], NOW, DEAD_LETTERED), NOW)
    s.close()
    out = subprocess.run([sys.executable, "-m", "timewheel", "inspect", "--data-dir", str(tmp_path / "d"), "--json"],
                         capture_output=True, text=True, check=True).stdout
    report = json.loads(out)
    first = report["segments"][0]
    assert (first["records"], first["dispatched"], first["cancelled"], first["dead_lettered"], first["pending"]) == (
        10, 4, 2, 1, 3)
    assert report["totals"]["records"] == 30 and report["totals"]["pending"] == 23
    assert report["totals"]["bytes"] > 0 and report["totals"]["corrupt"] == 0
    assert len(report["segments"]) == 3


def test_inspect_refuses_a_directory_that_is_not_a_store(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "timewheel", "inspect", "--data-dir", str(tmp_path)],
                         capture_output=True, text=True)
    assert res.returncode == 2 and "not a timewheel data directory" in res.stderr


@pytest.mark.parametrize("content", [
    pytest.param(b'{"format": 1, "segm', id="cut-short"),
    pytest.param(b"\xff\xfe{}", id="not-utf8"),
    pytest.param(b"[1, 60]", id="not-an-object"),
    pytest.param(b'{"format": 1}', id="no-segment-minutes"),
    pytest.param(b'{"format": 1, "segment_minutes": "60"}', id="text-minutes"),
    pytest.param(b'{"format": 1, "segment_minutes": 7}', id="minutes-not-dividing-a-day"),
])
def test_inspect_explains_a_bad_metadata_file(tmp_path: Path, content: bytes) -> None:
    ScheduleStore(tmp_path / "d").close()
    (tmp_path / "d" / "timewheel.json").write_bytes(content)
    res = subprocess.run([sys.executable, "-m", "timewheel", "inspect", "--data-dir", str(tmp_path / "d")],
                         capture_output=True, text=True)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.startswith("timewheel: ") and ("timewheel.json" in res.stderr or "segment_minutes" in res.stderr)
    with pytest.raises(StorageError):
        ScheduleStore(tmp_path / "d")


def test_a_format_1_directory_is_marked_format_2_when_opened_for_writing_and_a_newer_one_refused(
        tmp_path: Path) -> None:
    from storage.layout import FORMAT_VERSION, SegmentLayout

    d = tmp_path / "d"
    s = ScheduleStore(d)
    s.append(recs(3), NOW)
    s.close()
    marker = d / "timewheel.json"
    marker.write_text(json.dumps({"format": 1, "segment_minutes": 60}))
    SegmentLayout.open_existing(d)  # a reader beside the engine leaves it as it found it
    assert json.loads(marker.read_text())["format"] == 1
    s = ScheduleStore(d)  # what it writes (origins, TWD3 frames) a format-1 build would misread
    assert len(s.segment_index(s.layout.list_segments()[0])) == 3
    s.close()
    assert json.loads(marker.read_text()) == {"format": FORMAT_VERSION, "segment_minutes": 60} and FORMAT_VERSION == 2
    marker.write_text(json.dumps({"format": 3, "segment_minutes": 60}))
    with pytest.raises(StorageError, match="holds format 3, this build reads formats"):
        ScheduleStore(d)


def test_retention_removes_only_fully_done_old_segments(tmp_path: Path) -> None:
    s = ScheduleStore(tmp_path / "d")
    s.append(recs(4, step=HOUR), NOW)
    segs = s.layout.list_segments()
    s.seal_live_parts(NOW + 10 * HOUR)
    for seg in segs[:2]:
        ix = s.segment_index(seg)
        s.record_dispatch(seg, dispatch_entries(ix.part, ix.offset, ix.due_ms, NOW, DELIVERED), NOW)
    s.checkpoint()  # as the engine does before retention: none of them is replayed after a crash
    assert s.retire(NOW + 2 * HOUR, min_age_ms=HOUR) == [segs[0]]  # seg 1 is too young
    assert s.retire(NOW + 10 * HOUR, min_age_ms=HOUR, archive=True) == [segs[1]]  # 2, 3 pending
    assert s.layout.list_segments() == segs[2:]
    assert (s.layout.archive_dir / s.layout.segment_dir(segs[1]).name).is_dir()
    s.close()


def test_an_archived_segment_and_the_archive_directory_are_synced_in_place(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A move is durable only once the directory it lands in is synced (and a new directory once its
    parent is): schedule/ alone was, so a power loss could lose the archived copy."""
    synced: list[Path] = []
    real = retention_module.fsync_path

    def fsync_path(path: Path) -> None:
        synced.append(Path(path))
        real(path)

    monkeypatch.setattr(retention_module, "fsync_path", fsync_path)
    s = ScheduleStore(tmp_path / "d")
    s.append(recs(1), NOW)
    [seg] = s.layout.list_segments()
    s.seal_live_parts(NOW + 10 * HOUR)
    ix = s.segment_index(seg)
    s.record_dispatch(seg, dispatch_entries(ix.part, ix.offset, ix.due_ms, NOW, DELIVERED), NOW)
    s.checkpoint()
    assert s.retire(NOW + 10 * HOUR, min_age_ms=HOUR, archive=True) == [seg]
    s.close()
    assert s.layout.root in synced and s.layout.archive_dir in synced
    assert synced.index(s.layout.root) < synced.index(s.layout.archive_dir)


def test_check_reports_unknown_files(tmp_path: Path) -> None:
    s = ScheduleStore(tmp_path / "d")
    s.append(recs(1), NOW)
    s.close()
    (s.layout.segment_dir(s.layout.segment_start(NOW)) / "stray.bin").write_bytes(b"x")
    (s.layout.schedule_dir / "notasegment").mkdir()
    kinds = sorted(f.kind for f in check(s.layout).findings)
    assert kinds == ["unknown_file", "unknown_file"]


def test_restart_cost_does_not_scan_checkpointed_parts(tmp_path: Path) -> None:
    s = ScheduleStore(tmp_path / "d")
    s.append(recs(2000, step=HOUR // 100), NOW)
    s.close()
    s2 = ScheduleStore(tmp_path / "d")
    assert s2.recovery.replayed_records == 0 and s2.recovery.parts_repaired == 0
    assert s2.recovery.parts_checked == len(s2.layout.list_segments())
    s2.close()


def test_parts_from_two_writers_share_a_segment(tmp_path: Path) -> None:
    s = ScheduleStore(tmp_path / "d")
    s.append(recs(3), NOW)
    seg = s.layout.segment_start(NOW)
    staged = tmp_path / "d" / "schedule" / "stage"
    staged.mkdir()
    other = ScheduleStore(tmp_path / "other")
    other.append(recs(2, prefix="b"), NOW)
    other.close()
    import shutil
    shutil.copy(other.layout.part_log(seg, 0), staged / "x.log")
    shutil.copy(other.layout.part_index(seg, 0), staged / "x.idx")
    part = s.layout.publish_part(seg, staged / "x.log", staged / "x.idx")
    assert part == 1
    ix = s.segment_index(seg)
    assert len(ix) == 5 and ix.part.tolist() == [0, 0, 0, 1, 1]
    assert s.read_record(seg, 1, int(ix.offset[4])).msg_id == "b1"
    s.close()


def test_a_corrupt_ingest_frame_keeps_the_records_the_part_holds(tmp_path: Path) -> None:
    s = ScheduleStore(tmp_path / "d")
    wal = s._wal
    seq, ends = wal.seq, []
    for b in range(3):
        s.append(recs(10, prefix=f"b{b}-"), NOW)
        ends.append(wal.position)
    seg = s.layout.segment_start(NOW)
    crash(s)
    wal_path = wal.dir / f"{seq:012d}.wal"
    data = bytearray(wal_path.read_bytes())
    data[ends[0] + 40] ^= 0xFF
    wal_path.write_bytes(bytes(data))
    s2 = ScheduleStore(tmp_path / "d")
    try:
        # replay went on past the bad frame, and did not cut the part back to the last frame before it
        assert s2.recovery.replayed_records == 20 and s2.recovery.ingest_frames_skipped == 1
        assert any("corrupt" in f and "skipped" in f for f in s2.recovery.findings)
        ix = s2.segment_index(seg)
        ids = {s2.read_record(seg, 0, int(o)).msg_id for o in ix.offset}
        assert ids == {f"b{b}-{i}" for b in range(3) for i in range(10)}  # the part had them all
        assert check(s2.layout).ok
    finally:
        s2.close()


def test_retention_takes_the_ids_and_keys_of_retired_segments_out_of_the_meta_store(tmp_path: Path) -> None:
    s = ScheduleStore(tmp_path / "d")
    old = [Record(f"old{i}", "T", b"x", NOW + i, keys=("k-old", f"k{i}")) for i in range(3)]
    young = [Record("young", "T", b"y", NOW + 5 * HOUR, keys=("k-old",))]
    s.append(old + young, NOW)
    s.meta.mark_cancelled(["old0"], NOW)
    seg = s.layout.segment_start(NOW)
    s.seal_live_parts(NOW + 10 * HOUR)
    ix = s.segment_index(seg)
    s.record_dispatch(seg, dispatch_entries(ix.part, ix.offset, ix.due_ms, NOW, DELIVERED), NOW)
    assert sorted(s.meta.ids_for_key("k-old")) == ["old0", "old1", "old2", "young"]
    s.checkpoint()
    assert s.retire(NOW + 3 * HOUR, min_age_ms=HOUR) == [seg]
    assert s.meta.ids_for_key("k-old") == ["young"] and s.meta.ids_for_key("k1") == []
    assert s.meta.locations(["old0", "young"])[0] is None and s.meta.locations(["young"])[0] is not None
    assert s.meta.cancelled_at("old0") is None
    s.close()


@pytest.mark.parametrize("body_kib, n", [(256, 40), (1536, 7)], ids=["many-per-batch", "each-over-the-budget"])
def test_retiring_a_segment_of_large_messages_holds_a_bounded_number_of_bytes_at_a_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body_kib: int, n: int) -> None:
    """Retention reads a segment's records to forget their ids and keys: by a count alone, a segment
    of large messages was decoded gigabytes at a time. A record larger than the budget goes alone."""
    monkeypatch.setattr(retention_module, "_FORGET_BYTES", 1 << 20)
    s = ScheduleStore(tmp_path / "d")
    try:
        big = [Record(f"big{i}", "T", bytes([i]) * (body_kib << 10), NOW + i, keys=(f"k{i}",)) for i in range(n)]
        s.append(big, NOW)  # 10 MiB in one segment
        seg = s.layout.segment_start(NOW)
        s.seal_live_parts(NOW + HOUR)
        ix = s.segment_index(seg)
        s.record_dispatch(seg, dispatch_entries(ix.part, ix.offset, ix.due_ms, NOW, DELIVERED), NOW)
        del big
        s.checkpoint()
        tracemalloc.start()
        try:
            assert s.retire(NOW + 3 * HOUR, min_age_ms=HOUR) == [seg]
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < 4 << 20, f"retention held {peak / 2**20:.1f} MiB at once"
        assert s.meta.locations([f"big{i}" for i in range(n)]) == [None] * n
        assert s.meta.ids_for_key("k6") == []
    finally:
        s.close()


def test_the_meta_stores_memory_is_reported_by_kind_and_look_ups_fill_its_block_cache(tmp_path: Path) -> None:
    s = ScheduleStore(tmp_path / "d")
    try:
        s.append(recs(2000), NOW)
        s.checkpoint()  # flushed: look-ups now read the files on disk, through the block cache
        before = s.meta.memory_bytes()
        assert set(before) == {"block_cache", "memtables", "table_readers"}
        assert all(isinstance(v, int) and v >= 0 for v in before.values())
        assert all(loc is not None for loc in s.meta.locations([f"m{i}" for i in range(2000)]))
        assert s.meta.memory_bytes()["block_cache"] > before["block_cache"]
    finally:
        s.close()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _open_files_under(root: Path) -> list[str]:
    """What this process's descriptors point at under `root` (a deleted file ends in " (deleted)")."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the descriptor of the listing itself, closed meanwhile
            continue
        if target.startswith(str(root)):
            out.append(target)
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads the descriptors in /proc")
def test_a_retired_segment_leaves_no_descriptor_open_on_its_files(tmp_path: Path) -> None:
    """A deleted file held open keeps its disk space: after retention the retired segment's parts
    and dispatch log are closed, as well as deleted."""
    s = ScheduleStore(tmp_path / "d")
    try:
        s.append(recs(3) + recs(2, prefix="later", start=NOW + 2 * HOUR), NOW)
        seg = s.layout.segment_start(NOW)
        ix = s.segment_index(seg)
        s.record_dispatch(seg, dispatch_entries(ix.part, ix.offset, ix.due_ms, NOW, DELIVERED), NOW)
        seg_dir = s.layout.segment_dir(seg)
        assert _open_files_under(seg_dir), "the segment's dispatch log is open while it is written"
        s.seal_live_parts(NOW + HOUR)
        s.checkpoint()
        assert s.retire(NOW + 3 * HOUR, min_age_ms=HOUR) == [seg]
        assert not seg_dir.exists()
        assert _open_files_under(seg_dir) == []
        assert not [f for f in _open_files_under(tmp_path) if f.endswith("(deleted)")]
        s.append(recs(1, prefix="again", start=NOW + 2 * HOUR + 5), NOW + 2 * HOUR)  # the young segment goes on
        assert _ids_in(s, NOW + 2 * HOUR) == ["later0", "later1", "again0"]
    finally:
        s.close()


def _ids_in(s: ScheduleStore, seg: int) -> list[str]:
    """The ids of a segment's records, as read from its parts."""
    ix = s.segment_index(seg)
    read = s.read_records([seg] * len(ix), ix.part.tolist(), ix.offset.tolist())
    return [r.msg_id if isinstance(r, Record) else repr(r) for r in read]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads the descriptors in /proc")
def test_parts_read_without_their_segment_loaded_keep_a_bounded_number_of_maps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing releases the map of a part read outside the engine's loaded segments (a cancel's
    look-up of a message already delivered) until retention: at most `_MAX_READERS` stay open."""
    monkeypatch.setattr(reader_module, "_MAX_READERS", 3)
    s = ScheduleStore(tmp_path / "d")
    try:
        s.append([r for h in range(6) for r in recs(2, prefix=f"h{h}-", start=NOW + h * HOUR)], NOW)
        s.seal_live_parts(NOW + 6 * HOUR)
        segs = s.layout.list_segments()
        for k, seg in enumerate(segs):
            assert _ids_in(s, seg) == [f"h{k}-0", f"h{k}-1"]
            ix = s.segment_index(seg)
            raw = s.read_record_bytes(np.full(len(ix), seg, np.int64), ix.part.astype(np.int64),
                                      ix.offset.astype(np.int64))
            assert bool(raw.ok.all()) and len(raw) == 2
        assert len(_open_files_under(s.layout.schedule_dir)) == 2 * 3  # a reader: its file and its map's copy
        assert _ids_in(s, segs[0]) == ["h0-0", "h0-1"]  # closed, opened again
    finally:
        s.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads the descriptors in /proc")
def test_sealing_closes_the_sealed_parts_and_the_checkpoint_still_syncs_what_they_were_given(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = ScheduleStore(tmp_path / "d")
    try:
        s.append(recs(3) + recs(1, prefix="next", start=NOW + HOUR), NOW)
        seg = s.layout.segment_start(NOW)
        assert len(_open_files_under(s.layout.segment_dir(seg))) == 3  # log, index, origins
        s.seal_live_parts(seg + HOUR)
        assert _open_files_under(s.layout.segment_dir(seg)) == []
        assert len(_open_files_under(s.layout.segment_dir(seg + HOUR))) == 3  # still live
        synced: list[Path] = []
        real = checkpoints_module.fsync_path

        def recording_fsync(path: Path) -> None:
            synced.append(Path(path))
            real(path)

        monkeypatch.setattr(checkpoints_module, "fsync_path", recording_fsync)
        s.checkpoint()
        part = int(s.segment_index(seg).part[0])
        assert {s.layout.part_log(seg, part), s.layout.part_index(seg, part), s.layout.part_origin(seg, part)} <= \
            set(synced)
        s.append(recs(1, prefix="late", start=NOW + 10), NOW + HOUR)  # a sealed segment written again opens again
        assert _ids_in(s, seg) == ["m0", "m1", "m2", "late0"]
    finally:
        s.close()


def _failing_fsync(fd: object) -> None:
    raise OSError(5, "Input/output error")  # what a disk that went away answers


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts the descriptors in /proc")
def test_a_failed_checkpoint_closes_every_descriptor_it_duplicated(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkpoint fsyncs duplicates of the parts' descriptors: one failing fsync is raised, and
    the duplicates after it are closed all the same."""
    s = ScheduleStore(tmp_path / "data")
    try:
        s.append(recs(3), NOW)  # one part written: its log, index and origins to fsync
        before = _open_fds()
        with monkeypatch.context() as m:
            m.setattr(os, "fsync", _failing_fsync)
            with pytest.raises(OSError):
                s.checkpoint()
        assert _open_fds() == before  # the ingest log rolled to a new file: one closed, one opened
    finally:
        with pytest.raises(StorageWriteError, match="checkpoints are stopped"):
            s.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts the descriptors in /proc")
def test_a_close_whose_checkpoint_fails_still_closes_every_file(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A full or vanished disk at shutdown: the error is raised, every file is closed, and what the
    checkpoint did not make durable is replayed from the ingest log at the next open."""
    ScheduleStore(tmp_path / "warm").close()  # rocksdb's process-wide files are open from here on
    before = _open_fds()
    s = ScheduleStore(tmp_path / "data")
    s.append(recs(3), NOW)
    seg = s.layout.segment_start(NOW)
    ix = s.segment_index(seg)
    s.record_dispatch(seg, dispatch_entries(ix.part[:1], ix.offset[:1], ix.due_ms[:1], NOW, DELIVERED, 1), NOW)
    with monkeypatch.context() as m:
        m.setattr(os, "fsync", _failing_fsync)
        with pytest.raises(OSError):
            s.close()
    assert _open_fds() == before
    s.close()  # closed: a second close does nothing
    again = ScheduleStore(tmp_path / "data")
    assert len(again.segment_index(seg)) == 3
    again.close()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts the descriptors in /proc")
def test_a_store_that_fails_to_open_leaves_no_file_open(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first checkpoint fails (the disk went away): the caller gets an error and no store, so the
    meta store and the new ingest log file are closed before it is raised."""
    ScheduleStore(tmp_path / "warm").close()
    before = _open_fds()
    with monkeypatch.context() as m:
        m.setattr(checkpoints_module, "fsync_path", _failing_fsync)  # the checkpoint's, after the new log file
        with pytest.raises(OSError):
            ScheduleStore(tmp_path / "data")
    assert _open_fds() == before
    ScheduleStore(tmp_path / "data").close()  # and nothing holds its lock


def _ingest_dir_a_file(d: Path) -> type[BaseException]:
    shutil.rmtree(d / "ingest")
    (d / "ingest").write_bytes(b"")
    return FileExistsError


def _queue_table_damaged(d: Path) -> type[BaseException]:
    damage_one_document(d, "origin_queues", ["broker-a:0"])
    return MetaStoreCorruptError


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads the descriptors in /proc")
@pytest.mark.parametrize("fault", [_ingest_dir_a_file, _queue_table_damaged], ids=lambda f: f.__name__[1:])
def test_a_store_that_fails_before_its_recovery_leaves_nothing_open(tmp_path: Path,
                                                                     fault: Callable[[Path], type[BaseException]]) -> None:
    """The meta store was opened before the queue table was read from it and the ingest log's directory
    made, and only recovery's failure closed it: one of theirs left it open (its files, its thread and
    RocksDB's lock on the directory) for as long as the error was kept (a caller that raises its own
    `from` it keeps it), and the next open in the process was refused as "in use by another engine"."""
    d = stored(tmp_path)  # rocksdb's process-wide threads are running from here on
    expected = fault(d)
    threads = len(os.listdir("/proc/self/task"))
    with pytest.raises(expected) as failed:
        ScheduleStore(d)
    assert _open_files_under(d) == []
    assert len(os.listdir("/proc/self/task")) == threads  # an open database has a thread of its own
    if expected is MetaStoreCorruptError:
        with pytest.raises(MetaStoreCorruptError):  # the same words again, not "in use by another engine"
            ScheduleStore(d)
    else:
        (d / "ingest").unlink()
        ScheduleStore(d).close()
    assert failed.value.__traceback__ is not None  # kept to here, with the frames of the failed open


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts the descriptors in /proc")
def test_a_dispatch_log_whose_directory_cannot_be_synced_is_not_left_open(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """With flush="sync" a new dispatch log's directory is fsynced before its first frame: when that
    fails, the log's descriptor is closed with the error, not lost."""
    s = ScheduleStore(tmp_path / "data", flush="sync")
    try:
        s.append(recs(1), NOW)
        seg = s.layout.segment_start(NOW)
        ix = s.segment_index(seg)
        entries = dispatch_entries(ix.part, ix.offset, ix.due_ms, NOW, DELIVERED, 1)
        before = _open_fds()
        with monkeypatch.context() as m:
            m.setattr(os, "fsync", _failing_fsync)
            with pytest.raises(OSError):
                s.record_dispatch(seg, entries, NOW)
        assert _open_fds() == before
        s.record_dispatch(seg, entries, NOW)  # and the next frame opens it again
        assert len(s.dispatch_log(seg).entries) == 1
    finally:
        s.close()


def test_check_reports_a_torn_tail_that_stands_still_and_not_one_being_written(tmp_path: Path) -> None:
    s = ScheduleStore(tmp_path / "d")
    s.append(recs(5), NOW)
    s.close()
    seg = s.layout.segment_start(NOW)
    log, dl = s.layout.part_log(seg, 0), s.layout.dispatch_log(seg)
    with open(log, "ab") as f:
        f.write(b"\x00" * 11)  # half a record, and nothing writes after it: damage
    dl.write_bytes(b"\x01" * 7)
    kinds = sorted(f.kind for f in check(s.layout).findings)
    assert kinds == ["tail_mismatch", "torn_dispatch_log"]

    def append_meanwhile() -> None:  # a running engine finishing its writes while check watches
        for _ in range(10):
            threading.Event().wait(0.05)
            with open(log, "ab") as f:
                f.write(b"\x00")
            with open(dl, "ab") as f:
                f.write(b"\x00")

    writer = threading.Thread(target=append_meanwhile)
    writer.start()
    rep = check(s.layout)
    writer.join()
    assert rep.findings == [] and rep.tails_in_flight == 2


def test_check_fix_leaves_a_frame_the_engine_is_writing_whole(tmp_path: Path) -> None:
    """`check(fix=True)` beside a running engine: the engine is halfway through a frame (its log's
    lock held) when check reads the log. Check once cut the "torn tail" at once; the engine's
    write went on after the cut, and that frame and every one after it were unreadable. Now the
    cut waits for the lock and finds the frame whole."""
    import fcntl

    from storage.dispatch import encode_frame

    s = ScheduleStore(tmp_path / "d")
    s.append(recs(5), NOW)
    s.close()
    seg = s.layout.segment_start(NOW)
    dl = s.layout.dispatch_log(seg)
    entries = dispatch_entries(np.zeros(2, np.uint16), np.zeros(2, np.uint32), np.full(2, NOW, np.int64), NOW + 1,
                               DELIVERED, 1)
    first, second = encode_frame(entries[:1], NOW), encode_frame(entries, NOW + 1)
    dl.write_bytes(first)
    fd = os.open(dl, os.O_WRONLY | os.O_APPEND)
    fcntl.flock(fd, fcntl.LOCK_EX)  # the engine's writer, mid-frame
    os.write(fd, second[:40])
    result: list[Any] = []
    checker = threading.Thread(target=lambda: result.append(check(s.layout, fix=True, now_ms=NOW)))
    checker.start()
    checker.join(0.5)  # it read the torn tail and waits for the lock
    os.write(fd, second[40:])
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
    checker.join(30)
    [rep] = result
    read = read_dispatch_log(dl)
    assert (read.torn_bytes, read.corrupt_frames, len(read.entries)) == (0, 0, 3)
    assert rep.tails_in_flight == 1 and not [f for f in rep.findings if f.kind == "torn_dispatch_log"]


def test_an_old_segment_still_pending_is_read_again_only_once_it_was_written(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    s = ScheduleStore(tmp_path / "d")
    s.append(recs(3, step=1000), NOW)
    seg = s.layout.segment_start(NOW)
    s.seal_live_parts(NOW + 10 * HOUR)
    s.checkpoint()
    ix = s.segment_index(seg)
    reads: list[int] = []
    real = retention_module.summarize_segment

    def counted(layout: SegmentLayout, st: int) -> Any:
        reads.append(st)
        return real(layout, st)

    monkeypatch.setattr(retention_module, "summarize_segment", counted)
    s.record_dispatch(seg, dispatch_entries(ix.part[:2], ix.offset[:2], ix.due_ms[:2], NOW, DELIVERED), NOW)
    for _ in range(5):  # checkpoints while one record still retries
        assert s.retire(NOW + 10 * HOUR, min_age_ms=HOUR) == []
    assert reads == [seg]
    s.record_dispatch(seg, dispatch_entries(ix.part[2:], ix.offset[2:], ix.due_ms[2:], NOW, DELIVERED), NOW)
    assert s.retire(NOW + 10 * HOUR, min_age_ms=HOUR) == [seg]  # its last outcome: read again, and retired
    assert reads == [seg, seg] and s.pending_old == {}
    s.close()


def test_the_meta_stores_block_cache_stays_within_the_size_it_is_given(tmp_path: Path) -> None:
    used = {}
    for name, size in (("small", 256 << 10), ("default", None)):
        s = ScheduleStore(tmp_path / name, meta_cache_bytes=size)
        try:
            s.append(recs(40_000, step=50), NOW)
            s.checkpoint()  # flushed: look-ups read the files on disk, through the block cache
            s.meta.locations([f"m{i}" for i in range(40_000)])
            used[name] = s.meta.memory_bytes()["block_cache"]
        finally:
            s.close()
    assert used["small"] <= 256 << 10 < used["default"], used


def test_a_long_audit_tells_its_progress_segment_by_segment(tmp_path: Path) -> None:
    s = ScheduleStore(tmp_path / "d")
    s.append(recs(3, step=HOUR), NOW)
    s.close()
    seen: dict[str, list[tuple[int, int]]] = {"summarize": [], "check": []}
    summarize(s.layout, progress=lambda done, of: seen["summarize"].append((done, of)))
    check(s.layout, progress=lambda done, of: seen["check"].append((done, of)))
    assert seen == {"summarize": [(1, 3), (2, 3), (3, 3)], "check": [(1, 3), (2, 3), (3, 3)]}


def test_a_record_stored_in_a_segment_while_retention_decides_on_it_is_not_deleted(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A message that arrives long past due is stored in the old segment of its due time: retention
    once decided a segment was done, then deleted it with that newcomer in it (acknowledged, lost)."""
    s = ScheduleStore(tmp_path / "d")
    s.append(recs(2), NOW)
    seg = s.layout.segment_start(NOW)
    s.seal_live_parts(NOW + 10 * HOUR)
    ix = s.segment_index(seg)
    s.record_dispatch(seg, dispatch_entries(ix.part, ix.offset, ix.due_ms, NOW, DELIVERED), NOW)
    real = retention_module.summarize_segment
    late = Record("late", "T", b"arrived long past due", NOW + 500)

    def then_a_late_arrival(layout: SegmentLayout, st: int) -> Any:
        summary = real(layout, st)  # done: nothing pending
        s.append([late], NOW + 5 * HOUR)  # meanwhile, ingest stores a record into this segment
        return summary

    monkeypatch.setattr(retention_module, "summarize_segment", then_a_late_arrival)
    s.checkpoint()
    s.retire(NOW + 5 * HOUR, min_age_ms=HOUR)
    monkeypatch.undo()
    loc = s.meta.locations(["late"])[0]
    assert loc is not None and loc.segment_ms == seg
    assert s.read_record(seg, loc.part, loc.offset).body == late.body
    assert summarize_segment(s.layout, seg).pending == 1
    assert s.retire(NOW + 5 * HOUR, min_age_ms=HOUR) == []  # not while it waits
    s.close()


@pytest.mark.parametrize("meanwhile", ["a late arrival", "an outcome recorded again"])
def test_a_segment_whose_retirement_is_refused_keeps_its_ids_and_keys_in_the_meta_store(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, meanwhile: str) -> None:
    """Retention forgets a done segment's ids and keys, then moves it out under the write lock; a
    write into the segment in between refuses the move. The ids once stayed forgotten while their
    records stayed on disk: a look-up by id or key found nothing until a later retirement."""
    s = ScheduleStore(tmp_path / "d")
    s.append([Record(f"old{i}", "T", b"x", NOW + i, keys=("k-old", f"k{i}")) for i in range(3)], NOW)
    s.meta.mark_cancelled(["old0"], NOW - 1)
    seg = s.layout.segment_start(NOW)
    s.seal_live_parts(NOW + 10 * HOUR)
    ix = s.segment_index(seg)
    s.record_dispatch(seg, dispatch_entries(ix.part, ix.offset, ix.due_ms, NOW, DELIVERED), NOW)
    s.checkpoint()
    before = s.meta.locations([f"old{i}" for i in range(3)])
    real = retention_module.forget_segment_records

    def then_a_write(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)  # the ids are forgotten: the segment is about to go
        if meanwhile == "a late arrival":
            s.append([Record("late", "T", b"arrived long past due", NOW + 500)], NOW + 5 * HOUR)
        else:
            s.record_dispatch(seg, dispatch_entries(ix.part[:1], ix.offset[:1], ix.due_ms[:1], NOW, DELIVERED), NOW)
        return out

    monkeypatch.setattr(retention_module, "forget_segment_records", then_a_write)
    assert s.retire(NOW + 5 * HOUR, min_age_ms=HOUR) == []  # refused: the segment stays
    monkeypatch.undo()
    assert s.layout.list_segments() == [seg]
    assert s.meta.locations([f"old{i}" for i in range(3)]) == before, "a done record of a kept segment is not found by id"
    assert sorted(s.meta.ids_for_key("k-old")) == ["old0", "old1", "old2"] and s.meta.ids_for_key("k1") == ["old1"]
    assert s.meta.cancelled_at("old0") == NOW - 1
    if meanwhile == "a late arrival":  # done too now: the segment goes, and its ids with it
        late = s.meta.locations(["late"])[0]
        assert late is not None and late.segment_ms == seg
        s.record_dispatch(seg, dispatch_entries(np.array([late.part]), np.array([late.offset]), np.array([NOW + 500]),
                                                NOW, DELIVERED), NOW)
        s.seal_live_parts(NOW + 10 * HOUR)
        s.checkpoint()
    assert s.retire(NOW + 5 * HOUR, min_age_ms=HOUR) == [seg]
    assert s.meta.locations(["old0", "old1", "old2", "late"]) == [None] * 4 and s.meta.ids_for_key("k-old") == []
    assert s.meta.cancelled_at("old0") is None
    s.close()


def test_a_copy_stored_while_its_id_was_forgotten_keeps_its_own_entries_when_the_segment_stays(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a refused retirement gives back never overwrites an id stored again meanwhile, and it
    is still there after a crash."""
    s = ScheduleStore(tmp_path / "d")
    s.append([Record(f"old{i}", "T", b"x", NOW + i, keys=(f"k{i}",)) for i in range(2)], NOW)
    seg = s.layout.segment_start(NOW)
    s.seal_live_parts(NOW + 10 * HOUR)
    ix = s.segment_index(seg)
    s.record_dispatch(seg, dispatch_entries(ix.part, ix.offset, ix.due_ms, NOW, DELIVERED), NOW)
    s.checkpoint()
    first = s.meta.locations(["old0", "old1"])
    real = retention_module.forget_segment_records

    def then_a_copy(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        assert s.append([Record("old1", "T", b"again", NOW + 1, keys=("k-again",))], NOW + 5 * HOUR).new.all()
        return out

    monkeypatch.setattr(retention_module, "forget_segment_records", then_a_copy)
    assert s.retire(NOW + 5 * HOUR, min_age_ms=HOUR) == []
    monkeypatch.undo()
    copy = s.meta.locations(["old1"])[0]
    assert copy is not None and copy != first[1] and s.meta.ids_for_key("k-again") == ["old1"]
    crash(s)
    s = ScheduleStore(tmp_path / "d")
    assert s.meta.locations(["old0", "old1"]) == [first[0], copy]
    assert s.meta.ids_for_key("k0") == ["old0"] and s.meta.ids_for_key("k-again") == ["old1"]
    s.close()


def test_the_meta_stores_own_log_stays_bounded_across_restarts_and_checkpoints(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """RocksDB's info log once grew by every checkpoint's flush and kept one more file each restart."""
    monkeypatch.setattr(meta_module, "INFO_LOG_BYTES", 64 << 10)
    for restart in range(8):
        s = ScheduleStore(tmp_path / "d")
        for i in range(40):
            s.append(recs(5, prefix=f"r{restart}-{i}-"), NOW)
            s.checkpoint()  # a flush, logged
        s.close()
    logs = [p for p in (tmp_path / "d" / "meta").iterdir() if p.name.startswith("LOG")]
    assert len(logs) <= meta_module.INFO_LOG_FILES, sorted(p.name for p in logs)
    assert all(p.stat().st_size <= 2 * (64 << 10) for p in logs), [(p.name, p.stat().st_size) for p in logs]


def test_a_segment_archived_twice_keeps_both_copies(tmp_path: Path) -> None:
    """Archived, then stored to again by a message long past due, then archived again: the second
    move once failed on the first copy's name (and every checkpoint after it with it)."""
    s = ScheduleStore(tmp_path / "d")
    seg = s.layout.segment_start(NOW)
    for round_ in range(2):
        s.append([Record(f"r{round_}", "T", b"x", NOW + round_)], NOW + round_ * 10 * HOUR)
        s.seal_live_parts(NOW + 20 * HOUR)
        ix = s.segment_index(seg)
        s.record_dispatch(seg, dispatch_entries(ix.part, ix.offset, ix.due_ms, NOW, DELIVERED), NOW)
        s.checkpoint()
        assert s.retire(NOW + 20 * HOUR, min_age_ms=HOUR, archive=True) == [seg]
    name = s.layout.segment_dir(seg).name
    assert sorted(p.name for p in s.layout.archive_dir.iterdir()) == [name, f"{name}.1"]
    s.close()


def test_a_segment_is_not_retired_while_a_crash_would_replay_a_record_into_it(tmp_path: Path) -> None:
    """A message long past due, stored into an old segment and delivered before the next checkpoint:
    retention once retired the segment at once, and a crash then replayed the record from the ingest
    log into a new copy of it, pending, to be sent a second time."""
    s = ScheduleStore(tmp_path / "d")
    s.append(recs(2), NOW)
    seg = s.layout.segment_start(NOW)
    s.checkpoint()
    s.append([Record("late", "T", b"arrived long past due", NOW + 500)], NOW + 5 * HOUR)
    s.seal_live_parts(NOW + 10 * HOUR)
    ix = s.segment_index(seg)
    s.record_dispatch(seg, dispatch_entries(ix.part, ix.offset, ix.due_ms, NOW, DELIVERED), NOW)
    assert summarize_segment(s.layout, seg).pending == 0
    retired = s.retire(NOW + 5 * HOUR, min_age_ms=HOUR)
    crash(s)
    s = ScheduleStore(tmp_path / "d")
    assert s.recovery.replayed_records == 1
    assert summarize_segment(s.layout, seg).pending == 0  # nothing to send again (the old code: 1)
    assert retired == []  # "late" was past the last checkpoint
    assert s.retire(NOW + 5 * HOUR, min_age_ms=HOUR) == [seg]  # the open checkpointed
    s.close()


def test_checkpoints_finish_in_the_order_they_rotated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two checkpoints in flight (housekeeping's, and a commit's whose ingest log file filled): the
    later one finishing first once moved the checkpoint, and let the ingest log go, before the
    earlier one's parts were fsynced."""
    s = ScheduleStore(tmp_path / "d")
    events: list[str] = []
    real_fsync, real_put = os.fsync, s.meta.put_document
    s.append(recs(3), NOW)
    with s._write_lock:
        first = s._checkpoints.rotate()
    s.append(recs(3, prefix="n", start=NOW + HOUR), NOW)
    with s._write_lock:
        second = s._checkpoints.rotate()
    names = {fd: f"first {fd}" for fd in first.fds} | {fd: f"second {fd}" for fd in second.fds}

    def fsync(fd: int) -> None:
        events.append(names.pop(fd, "other"))  # a number closed is used again
        real_fsync(fd)

    def put_document(name: str, doc: Any) -> None:
        events.append(f"{name} {doc['seq']}")
        real_put(name, doc)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(s.meta, "put_document", put_document)
    s._checkpoints.finish(second)
    s._checkpoints.finish(first)  # nothing left to do
    assert first.fds and second.fds
    marks = [e.split()[0] for e in events if e != "other"]
    assert marks == ["first"] * len(first.fds) + ["second"] * len(second.fds) + ["checkpoint"], events
    assert events[-1] == f"checkpoint {second.seq}"
    s.close()


def test_a_failed_fsync_stops_checkpoints_and_keeps_the_ingest_log(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """After an fsync fails the kernel may have dropped the pages and marked them clean: the next
    checkpoint once succeeded, moved past them and deleted the ingest log that held them. Now every
    later checkpoint fails with the first error, and a restart replays the log."""
    s = ScheduleStore(tmp_path / "d")
    s.append(recs(3), NOW)
    with monkeypatch.context() as m:
        m.setattr(os, "fsync", _failing_fsync)
        with pytest.raises(StorageWriteError, match="Input/output error"):
            s.checkpoint()
    s.append(recs(2, prefix="after"), NOW)
    with pytest.raises(StorageWriteError, match="checkpoints are stopped: an fsync .* failed"):
        s.checkpoint()  # the disk answers again: too late for the pages it dropped
    crash(s)
    again = ScheduleStore(tmp_path / "d")
    assert again.recovery.replayed_records == 5  # the old code: 0 (the log was gone, the parts never fsynced)
    assert len(again.segment_index(again.layout.segment_start(NOW))) == 5
    again.close()


def test_a_batch_the_meta_store_refuses_is_cut_so_its_retry_stores_it_once(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk stops RocksDB's writes after the parts took a batch: the batch once stayed in the
    parts, and was handed to the timer, while its ids were not recorded, so the producer's retry
    stored and scheduled every record a second time (two deliveries each)."""
    s = ScheduleStore(tmp_path / "d")
    handed: list[int] = []
    s.commit_listeners.append(lambda written: handed.append(len(written)))
    batch = recs(3)

    def refused(*args: Any, **kw: Any) -> None:
        raise Exception("IO error: No space left on device: While appending to file")  # rocksdict's own type

    with monkeypatch.context() as m:
        m.setattr(s.meta, "put_records", refused)
        with pytest.raises(StorageWriteError, match="No space left on device.*nothing of this batch was kept"):
            s.append(batch, NOW)
    assert handed == [] and len(s.segment_index(s.layout.segment_start(NOW))) == 0
    assert s.append(batch, NOW).new.all()  # the retry, once the disk has room
    assert handed == [3] and len(s.segment_index(s.layout.segment_start(NOW))) == 3  # the old code: 6
    crash(s)
    again = ScheduleStore(tmp_path / "d")
    assert len(again.segment_index(again.layout.segment_start(NOW))) == 3  # nothing of it replayed
    again.close()


def test_a_commit_listener_that_fails_does_not_turn_a_stored_batch_into_a_failed_one(tmp_path: Path) -> None:
    """The records are in the ingest log, the parts and the meta store before the listeners hear of
    them. A listener's error was once raised as the commit's: the caller retried, the retry found
    every id stored and handed nothing on, so the timer never heard of the records. Now the commit
    stands, every listener is called, and the failure is kept for the engine to stop on."""
    s = ScheduleStore(tmp_path / "d")
    handed: list[int] = []
    assert getattr(s, "commit_listener_failure", None) is None

    def failing(written: np.ndarray) -> None:
        raise MemoryError("the listener could not keep the records")

    s.commit_listeners.extend([failing, lambda written: handed.append(len(written))])
    result = s.append(recs(3), NOW)  # the old code: MemoryError, with the 3 records stored
    assert result.new.all() and handed == [3]
    assert "MemoryError: the listener could not keep the records" in (s.commit_listener_failure or "")
    assert len(s.segment_index(s.layout.segment_start(NOW))) == 3
    s.commit_listeners.remove(failing)
    assert s.append(recs(2, prefix="later"), NOW).new.all() and handed == [3, 2]
    assert s.commit_listener_failure is not None  # kept: what the failed listener missed is still missing
    s.close()


def test_a_record_stored_in_a_segment_marked_done_makes_it_pending_again_even_across_a_crash(
        tmp_path: Path) -> None:
    """A start never loads a segment marked done: a record that arrives in one later (late) once
    stayed on disk unsent after a restart. Its commit clears the mark; a crash loses that write with
    the record's id (both unlogged), and the replay of the ingest log writes both again."""
    s = ScheduleStore(tmp_path / "d")
    seg = s.layout.segment_start(NOW)
    s.append(recs(1), NOW)
    s.checkpoint()
    s.meta.mark_segment_done(seg)
    s.meta.mark_segment_done(seg - HOUR)
    assert s.append(recs(1, prefix="late", start=NOW + 5), NOW + 2 * HOUR).new.all()
    assert s.meta.done_segments() == {seg - HOUR}  # the old code: the segment stayed done
    crash(s)
    again = ScheduleStore(tmp_path / "d")
    assert again.recovery.replayed_records == 1 and again.meta.done_segments() == {seg - HOUR}
    again.meta.mark_segment_done(seg)
    again.meta.forget_segment(seg - HOUR)
    assert again.meta.done_segments() == {seg}
    again.close()


def test_no_segment_is_marked_done_once_a_commit_listener_failed(tmp_path: Path) -> None:
    """What the failed listener missed is in no inbound list: nothing tells its segment is not done."""
    s = ScheduleStore(tmp_path / "d")
    seg = s.layout.segment_start(NOW)
    assert s.mark_segment_done(seg - HOUR, lambda: True) and not s.mark_segment_done(seg - 2 * HOUR, lambda: False)

    def failing(written: np.ndarray) -> None:
        raise MemoryError("the listener could not keep the records")

    s.commit_listeners.append(failing)
    s.append(recs(1), NOW)
    assert not s.mark_segment_done(seg, lambda: True) and s.meta.done_segments() == {seg - HOUR}
    s.close()


def test_a_failed_fsync_of_the_ingest_directory_stops_checkpoints_for_good(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkpoint fsyncs the ingest log's directory (the new file's name) before it moves on: that
    fsync failing once let the next checkpoint fsync it again, succeed on pages the kernel had
    dropped, and let the ingest log go past what may not be on disk."""
    s = ScheduleStore(tmp_path / "data")
    s.append(recs(3), NOW)
    durable = s._checkpoints.durable_seq
    ingest_dir = str(s.layout.ingest_dir)
    real = checkpoints_module.fsync_path

    def failing_for_the_directory(path: Any) -> None:
        if str(path) == ingest_dir:
            raise OSError(5, "Input/output error")
        real(path)

    with monkeypatch.context() as m:
        m.setattr(checkpoints_module, "fsync_path", failing_for_the_directory)
        with pytest.raises(StorageWriteError, match="checkpoints are stopped: the fsync of the ingest log's dir"):
            s.checkpoint()
    s.append(recs(2, prefix="after"), NOW)
    with pytest.raises(StorageWriteError, match="checkpoints are stopped"):
        s.checkpoint()  # the directory fsyncs fine now: proves nothing, the checkpoint stays where it was
    assert s._checkpoints.durable_seq == durable
    with pytest.raises(StorageWriteError, match="checkpoints are stopped"):
        s.close()
    s = ScheduleStore(tmp_path / "data")  # the restart replays the ingest log: nothing lost
    try:
        assert s.meta.known(["m0", "m1", "m2", "after0", "after1"]) == [True] * 5
    finally:
        s.close()
