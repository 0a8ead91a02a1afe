"""A meta store whose table files a failing disk damaged: every read, scan and open that meets the
damage raises `MetaStoreCorruptError`, naming the meta directory and the file RocksDB found damaged.
rocksdict raised a bare `Exception` from a read, answered a scan with nothing (an iterator that meets
an error just ends), and an open's "block checksum mismatch" was taken for RocksDB's lock ("in use by
another engine"). `check()` reads the meta store through and reports its damage."""
from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Callable

import pytest

from storage import MetaStore, MetaStoreCorruptError, Record, ScheduleStore, SegmentLayout, StorageError, check
from tests.storage._meta_damage import NOW, damage_data_blocks, damage_one_document, damage_tables_whole, stored
from tests.storage.test_store import crash


def _is_named(e: MetaStoreCorruptError, data_dir: Path, damaged: list[Path]) -> None:
    assert isinstance(e, StorageError)
    assert e.meta_dir == str(data_dir / "meta"), e.meta_dir
    assert e.file in [str(t) for t in damaged], (e.file, damaged)
    assert e.detail.startswith("Corruption:"), e.detail
    text = str(e)
    assert str(data_dir / "meta") in text and e.file in text and "corrupt" in text, text
    assert "in use by another engine" not in text, text


_READS: dict[str, Callable[[MetaStore], object]] = {
    "known": lambda m: m.known(["m0"]),
    "locations": lambda m: m.locations(["m0", "m1"]),
    "cancelled_at": lambda m: m.cancelled_at("m0"),
    "get_document": lambda m: m.get_document("checkpoint"),
    "ids_for_key": lambda m: m.ids_for_key("k"),
    "ids_with_prefix": lambda m: m.ids_with_prefix("m"),
}


@pytest.mark.parametrize("read_only", [True, False], ids=["read-only", "read-write"])
@pytest.mark.parametrize("read", sorted(_READS))
def test_a_read_that_meets_a_damaged_block_raises_meta_store_corrupt(tmp_path: Path, read: str,
                                                                      read_only: bool) -> None:
    d = stored(tmp_path)
    damaged = damage_data_blocks(d)
    meta = MetaStore(d / "meta", read_only=read_only)  # the blocks read at open are whole
    try:
        with pytest.raises(MetaStoreCorruptError) as raised:
            _READS[read](meta)
    finally:
        meta.close()
    _is_named(raised.value, d, damaged)


def test_an_open_whose_done_marks_cannot_be_read_raises_rather_than_taking_none_for_done(tmp_path: Path) -> None:
    """The marks are read by a scan at open: one that met the damage ended early, and every segment
    marked done was taken for pending."""
    meta_dir = tmp_path / "meta"
    meta = MetaStore(meta_dir)
    meta.mark_segment_done(1_795_460_400_000, [0])
    meta.flush()
    meta.close()
    damaged = damage_data_blocks(tmp_path)
    with pytest.raises(MetaStoreCorruptError) as raised:
        MetaStore(meta_dir).close()
    assert raised.value.file in [str(t) for t in damaged]
    with pytest.raises(MetaStoreCorruptError):  # not "in use by another engine": the lock was let go
        MetaStore(meta_dir).close()


@pytest.mark.parametrize("read_only", [True, False], ids=["read-only", "read-write"])
def test_an_open_that_meets_damage_says_the_store_is_corrupt_not_in_use(tmp_path: Path, read_only: bool) -> None:
    d = stored(tmp_path)
    damaged = damage_tables_whole(d)
    with pytest.raises(MetaStoreCorruptError) as raised:
        MetaStore(d / "meta", read_only=read_only).close()
    _is_named(raised.value, d, damaged)


def test_what_is_not_damage_passes_as_it_was(tmp_path: Path) -> None:
    """Only RocksDB's "Corruption:" is taken for damage: its lock is still "in use", and any other
    error of rocksdict reaches the caller unchanged."""
    d = stored(tmp_path)
    meta = MetaStore(d / "meta")
    try:
        with pytest.raises(StorageError, match="in use by another engine") as locked:
            MetaStore(d / "meta")
        assert not isinstance(locked.value, MetaStoreCorruptError)
    finally:
        meta.close()
    with pytest.raises(Exception) as closed:
        meta.get_document("checkpoint")  # a store used after its close
    assert not isinstance(closed.value, StorageError), repr(closed.value)


@pytest.mark.parametrize("damage", [damage_data_blocks, damage_tables_whole], ids=["data blocks", "whole tables"])
def test_check_reports_a_corrupt_meta_store_and_checks_the_rest(tmp_path: Path,
                                                                damage: Callable[[Path], list[Path]]) -> None:
    d = stored(tmp_path)
    assert check(SegmentLayout.open_existing(d)).ok
    damaged = damage(d)
    rep = check(SegmentLayout.open_existing(d))
    (finding,) = rep.findings
    assert finding.kind == "corrupt_meta_store" and finding.path in [str(t) for t in damaged], finding
    assert "Corruption:" in finding.detail, finding
    assert rep.segments == 1 and rep.records == 3 and rep.corrupt_records == 0  # the segments, checked as ever


def test_check_of_a_directory_no_engine_opened_finds_no_meta_store_to_read(tmp_path: Path) -> None:
    layout = SegmentLayout(tmp_path / "data", 60)  # what `timewheel init` makes: no meta store yet
    assert check(layout).ok
    assert not (tmp_path / "data" / "meta" / "CURRENT").exists()  # and the check made none


def test_a_store_opened_without_its_meta_store_keeps_every_record_and_forgets_ids_stored_before(
        tmp_path: Path) -> None:
    """What moving a corrupt `meta/` aside does (docs/OPERATIONS.md, "A corrupt meta store"): the records
    stay as they were, the ingest log since the last checkpoint is replayed as at every start, and the ids
    stored before that checkpoint are no longer known."""
    d = tmp_path / "data"
    s = ScheduleStore(d)
    s.append([Record(f"old{i}", "ORDERS", b"x", NOW + i, keys=("k",)) for i in range(3)], NOW)
    s.checkpoint()
    s.append([Record(f"new{i}", "ORDERS", b"y", NOW + 10 + i, keys=("k",)) for i in range(2)], NOW)
    crash(s)  # the last batch only in the ingest log (and the page cache)
    shutil.copytree(d, tmp_path / "kept")
    shutil.move(d / "meta", tmp_path / "meta-aside")
    with ScheduleStore(d) as again, ScheduleStore(tmp_path / "kept") as kept:
        assert again.recovery.replayed_records == 2
        assert again.meta.known(["old0", "old1", "old2", "new0", "new1"]) == [False] * 3 + [True] * 2
        seg = again.layout.segment_start(NOW)
        idx, kept_idx = again.segment_index(seg), kept.segment_index(seg)
        assert list(idx.offset) == list(kept_idx.offset) and list(idx.due_ms) == list(kept_idx.due_ms)
        read = again.read_records([seg] * len(idx), list(idx.part), list(idx.offset))
        assert [r.msg_id for r in read if isinstance(r, Record)] == ["old0", "old1", "old2", "new0", "new1"]


def _until_writes_are_refused(meta: MetaStore, name: str) -> None:
    """Write the document `name` again and again, each time into a table of its own, until RocksDB's
    compaction of those tables reads the damaged one: from then on it refuses every write (its
    background error), as an engine's store meets it when a compaction finds damage."""
    deadline = time.monotonic() + 60  # a compaction runs on RocksDB's own thread, late on a loaded machine
    n = 0
    while time.monotonic() < deadline:
        n += 1
        try:
            meta.put_document(name, n)
            meta.flush()
        except MetaStoreCorruptError:
            return
        time.sleep(0.02)
    raise AssertionError(f"no compaction read the damaged table in {n} flushes")


def test_an_append_refused_for_damage_keeps_nothing_and_says_the_store_is_corrupt(tmp_path: Path) -> None:
    """A write RocksDB refuses because a compaction found damage was raised as StorageWriteError telling
    the operator to free disk space: the advice of a full disk for a corrupt store, which no space mends.
    The batch is still cut back whole (its caller acknowledges nothing), and the store's close, whose last
    checkpoint cannot flush the meta store either, says the same (rocksdict's bare `Exception` escaped)."""
    d = stored(tmp_path)
    damaged = damage_one_document(d, "shaping_rules", {"rules": {}})
    store = ScheduleStore(d)
    seg = store.layout.segment_start(NOW)
    try:
        before = (list(store.segment_index(seg).offset), store._wal.seq, store._wal.position)
        _until_writes_are_refused(store.meta, "shaping_rules")
        with pytest.raises(MetaStoreCorruptError) as raised:
            store.append([Record("new0", "ORDERS", b"x", NOW + 9_000, keys=("k",))], NOW)
        _is_named(raised.value, d, [damaged])
        assert "disk space" not in str(raised.value)
        assert (list(store.segment_index(seg).offset), store._wal.seq, store._wal.position) == before
    finally:
        with pytest.raises(MetaStoreCorruptError) as closing:
            store.close()
    _is_named(closing.value, d, [damaged])
    with ScheduleStore(tmp_path / "again") as fresh:  # and the close let go of what it held
        assert fresh.meta.known(["new0"]) == [False]
    shutil.move(d / "meta", tmp_path / "meta-aside")
    with ScheduleStore(d) as moved:  # what docs/OPERATIONS.md says to do: the refused batch is not replayed
        assert len(moved.segment_index(seg)) == 3 and moved.recovery.replayed_records == 0
