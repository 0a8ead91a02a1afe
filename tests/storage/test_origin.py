"""Origin sidecars: every stored record knows its (queue, offset) on the delay topic, across restarts
and recovery; records without one read as unknown, a row that fails its check (or a sidecar cut short
lost) reads as lost and is reported, and a sidecar never misaligns with its index."""
from __future__ import annotations

import os
from pathlib import Path

import crc32c
import numpy as np
import pytest

from storage import LOST_QUEUE, NO_QUEUE, Record, ScheduleStore, check
from storage.origin import ORIGIN_DTYPE, ORIGIN_ROW_SIZE, good_rows, origin_rows, unknown_origins
from tests.storage._deleted_under_writer import MOMENTS, delete_under_writer

T0 = 1_700_000_000_000


def _records(n: int, start: int = 0) -> list[Record]:
    return [Record(f"id-{start + i}", "T", b"x" * (i % 7), T0 + (start + i) * 10) for i in range(n)]


def _origins_of(store: ScheduleStore, ids: list[str]) -> list[tuple[str, int] | str | None]:
    """Each record's origin: (queue name, offset), None for unknown, "lost" for a row written and lost."""
    locs = [loc for loc in store.meta.locations(ids) if loc is not None]
    assert len(locs) == len(ids)
    segs = np.array([loc.segment_ms for loc in locs], np.int64)
    parts = np.array([loc.part for loc in locs], np.int64)
    offs = np.array([loc.offset for loc in locs], np.int64)
    rows = store.read_origins(segs, parts, offs)
    names = store.queues.names()
    return [None if int(r["queue"]) == NO_QUEUE else "lost" if int(r["queue"]) == LOST_QUEUE
            else (names[int(r["queue"])], int(r["offset"])) for r in rows]


def test_origins_are_kept_per_record_and_survive_a_restart(tmp_path: Path) -> None:
    store = ScheduleStore(tmp_path)
    recs = _records(50)
    origins = [(f"broker-{i % 2}:{i % 4}", 1_000_000_000_000 + i) if i % 5 else None for i in range(50)]
    store.append(recs, T0, origins)
    ids = [r.msg_id for r in recs]
    assert _origins_of(store, ids) == origins
    store.close()
    again = ScheduleStore(tmp_path)
    try:
        assert _origins_of(again, ids) == origins
        more = _records(10, 50)
        again.append(more, T0, [("broker-9:3", 7)] * 10)  # a queue the table did not know
        assert _origins_of(again, [r.msg_id for r in more]) == [("broker-9:3", 7)] * 10
        assert _origins_of(again, ids) == origins
    finally:
        again.close()


def test_records_stored_without_an_origin_read_as_unknown(tmp_path: Path) -> None:
    with ScheduleStore(tmp_path) as store:
        recs = _records(5)
        store.append(recs, T0)
        assert _origins_of(store, [r.msg_id for r in recs]) == [None] * 5


def test_a_sidecar_shorter_than_its_index_reads_lost_past_its_end(tmp_path: Path) -> None:
    store = ScheduleStore(tmp_path)
    recs = _records(8)
    store.append(recs, T0, [("b:0", i) for i in range(8)])
    ids = [r.msg_id for r in recs]
    store.close()
    (org,) = list(tmp_path.glob("schedule/*/*.org"))
    os.truncate(org, 5 * ORIGIN_ROW_SIZE)  # the page cache lost the last rows
    with ScheduleStore(tmp_path) as store:
        assert _origins_of(store, ids) == [("b:0", i) for i in range(5)] + ["lost"] * 3


def _stored_then_crashed(data_dir: Path) -> list[str]:
    """Six records from queue b:1 (offsets 100-105) stored, then a crash before any checkpoint: the
    ingest log replays them at the next open. Their ids."""
    store = ScheduleStore(data_dir)
    recs = _records(6)
    store.append(recs, T0, [("b:1", 100 + i) for i in range(6)])
    store._wal.close()
    store.writer.close()
    store.meta.close()
    return [r.msg_id for r in recs]


def test_a_replayed_ingest_log_keeps_the_origin_rows_that_were_written(tmp_path: Path) -> None:
    ids = _stored_then_crashed(tmp_path)  # and the index lost: the ingest log replays the records
    (idx,) = list(tmp_path.glob("schedule/*/*.idx"))
    os.truncate(idx, 0)
    with ScheduleStore(tmp_path) as again:
        assert again.recovery.replayed_records == 6
        assert _origins_of(again, ids) == [("b:1", 100 + i) for i in range(6)]


def test_origin_rows_an_os_crash_took_are_written_back_as_lost_when_the_ingest_log_replays(tmp_path: Path) -> None:
    # the ingest log holds no origins: rows the page cache lost (a short sidecar, or none) read as
    # unknown after the replay, which a replica set judges by its watermark alone
    for cut in (3 * ORIGIN_ROW_SIZE + 5, None):  # a torn tail, or the sidecar's name lost
        d = tmp_path / f"cut-{cut}"
        ids = _stored_then_crashed(d)
        (org,) = list(d.glob("schedule/*/*.org"))
        if cut is None:
            org.unlink()
        else:
            os.truncate(org, cut)
        with ScheduleStore(d) as again:
            assert again.recovery.replayed_records == 6
            kept = 3 if cut is not None else 0
            assert _origins_of(again, ids) == [("b:1", 100 + i) for i in range(kept)] + ["lost"] * (6 - kept)
        assert org.stat().st_size == 6 * ORIGIN_ROW_SIZE  # written back whole: lost, durably
        with ScheduleStore(d) as reopened:
            assert reopened.origins.corrupt_rows == 0 and _origins_of(reopened, ids)[kept:] == ["lost"] * (6 - kept)


def test_a_new_queue_number_is_durable_before_a_row_can_name_it(tmp_path: Path) -> None:
    # a checkpoint fsyncs the parts before it flushes the meta store: a row naming a number the
    # table lost to a power loss would name whichever queue took that number next
    from storage.origin import QueueTable

    class Meta:
        def __init__(self) -> None:
            self.puts: list[tuple[str, object, bool]] = []

        def get_document(self, name: str) -> object:
            return None

        def put_document(self, name: str, value: object, *, sync: bool = False) -> None:
            self.puts.append((name, value, sync))

    meta = Meta()
    table = QueueTable(meta)
    assert table.numbers(["broker-a:0", "broker-a:1", None]).tolist() == [0, 1, NO_QUEUE]
    assert table.numbers(["broker-a:1"]).tolist() == [1]  # known: nothing written
    assert meta.puts == [("origin_queues", ["broker-a:0", "broker-a:1"], True)]
    # the usual commit (one queue's rows), no row, unknown rows only, and rows mixed
    assert table.numbers(["broker-a:1"] * 3).tolist() == [1, 1, 1]
    assert table.numbers([]).tolist() == []
    assert table.numbers([None, None]).tolist() == [NO_QUEUE, NO_QUEUE]
    assert table.numbers(["broker-a:1", None, "broker-a:0", "broker-a:1"]).tolist() == [1, NO_QUEUE, 0, 1]
    assert table.numbers(["broker-a:1"] * 3).dtype == np.int32


def test_the_queue_table_reads_back_after_a_restart(tmp_path: Path) -> None:
    store = ScheduleStore(tmp_path)
    try:
        assert store.queues.numbers(["broker-b:3", "broker-a:0"]).tolist() == [0, 1]
    finally:
        store.close()
    store = ScheduleStore(tmp_path)
    try:
        assert store.queues.names() == ["broker-b:3", "broker-a:0"]
    finally:
        store.close()


def test_origin_rows_a_power_loss_left_as_zeros_read_as_lost(tmp_path: Path) -> None:
    # a filesystem that writes a file's size back before its data (ext4 data=writeback) leaves the
    # rows that never reached the disk as zeros: queue 0, offset 0, which is no origin of theirs
    ids = _stored(tmp_path, [("b:0", 1000 + i) for i in range(8)])
    (org,) = list(tmp_path.glob("schedule/*/*.org"))
    with open(org, "r+b") as f:
        f.seek(5 * ORIGIN_ROW_SIZE)
        f.write(bytes(3 * ORIGIN_ROW_SIZE))
    with ScheduleStore(tmp_path) as store:
        assert _origins_of(store, ids) == [("b:0", 1000 + i) for i in range(5)] + ["lost"] * 3


def _stored(data_dir: Path, origins: list[tuple[str, int] | None]) -> list[str]:
    """A record for each origin, stored and checkpointed (the store closed); their ids."""
    with ScheduleStore(data_dir) as store:
        recs = _records(len(origins))
        store.append(recs, T0, origins)
    return [r.msg_id for r in recs]


def _sidecar_rows(tmp_path: Path) -> tuple[Path, np.ndarray]:
    (org,) = list(tmp_path.glob("schedule/*/*.org"))
    return org, np.fromfile(org, ORIGIN_DTYPE)


def test_a_damaged_origin_row_reads_as_lost_and_is_reported(tmp_path: Path) -> None:
    ids = _stored(tmp_path, [("b:0", 10 + i) for i in range(4)])
    org, rows = _sidecar_rows(tmp_path)
    rows["offset"][2] ^= 1 << 40  # one bit flipped: another offset, which the check no longer matches
    rows.tofile(org)
    with ScheduleStore(tmp_path) as store:
        assert _origins_of(store, ids) == [("b:0", 10), ("b:0", 11), "lost", ("b:0", 13)]
        assert store.origins.corrupt_rows == 1
        _origins_of(store, ids)
        assert store.origins.corrupt_rows == 1  # counted once, however often it is read
        found = [(f.kind, f.path) for f in check(store.layout).findings]
    assert found == [("corrupt_origin", str(org))]


def test_rows_written_before_rows_carried_a_check_read_as_they_were_written(tmp_path: Path) -> None:
    # the previous build wrote 0 where the check now is: those rows keep their origins after an
    # upgrade in place, except an all-zero row (lost data looks the same) and one naming no origin
    ids = _stored(tmp_path, [("b:0", 7), ("b:1", 0), ("b:0", 0), None, ("b:1", 9)])
    org, rows = _sidecar_rows(tmp_path)
    rows["check"] = 0
    rows["offset"][4] = -9
    rows.tofile(org)
    with ScheduleStore(tmp_path) as store:
        assert _origins_of(store, ids) == [("b:0", 7), ("b:1", 0), "lost", None, "lost"]
        assert store.origins.corrupt_rows == 2


def test_the_vectorised_check_is_the_crc32c_of_each_rows_queue_and_offset() -> None:
    rng = np.random.default_rng(7)
    rows = origin_rows(rng.integers(-1, 1 << 31, 1000, dtype=np.int64).astype(np.int32),
                       rng.integers(0, 1 << 62, 1000, dtype=np.int64))
    raw = rows.tobytes()
    want = [crc32c.crc32c(raw[k:k + 4] + raw[k + 8:k + 16]) for k in range(0, len(raw), ORIGIN_ROW_SIZE)]
    assert rows["check"].tolist() == want
    assert good_rows(rows).all()
    assert not good_rows(np.zeros(3, ORIGIN_DTYPE)).any()  # the CRC32C of 12 zero bytes is not 0
    assert good_rows(unknown_origins(2)).all()


def _one_part_stored(data_dir: Path, n: int) -> Path:
    """`n` records of one part stored with origins and checkpointed (the store closed): the part's
    origin sidecar."""
    _stored(data_dir, [("b:0", 500 + i) for i in range(n)])
    (org,) = list(data_dir.glob("schedule/*/*.org"))
    return org


@pytest.mark.parametrize("cut_rows", [0, 1.5])
def test_check_reports_an_origin_sidecar_shorter_than_its_part(tmp_path: Path, cut_rows: float) -> None:
    # its missing rows read as lost: an operator verifying the data directory is told which file lacks them
    org = _one_part_stored(tmp_path, 4)
    os.truncate(org, int(cut_rows * ORIGIN_ROW_SIZE))
    with ScheduleStore(tmp_path) as store:
        found = check(store.layout).findings
    assert [(f.kind, f.path) for f in found] == [("corrupt_origin", str(org))]
    have = int(cut_rows)
    assert f"holds {have} of 4 rows" in found[0].detail
    assert f"{4 - have} read as origin lost" in found[0].detail
    assert "fix=True" in found[0].detail and "writes the rows it lacks as lost" in found[0].detail


@pytest.mark.parametrize("cut_rows", [0, 1.5, 3])
def test_check_fix_mends_an_origin_sidecar_shorter_than_its_part(tmp_path: Path, cut_rows: float) -> None:
    # its rows are kept, a torn row cut, the rows it lacks written as lost: it reads as before, and
    # is whole again (one row per index entry)
    org = _one_part_stored(tmp_path, 4)
    os.truncate(org, int(cut_rows * ORIGIN_ROW_SIZE))
    have = int(cut_rows)
    with ScheduleStore(tmp_path) as store:
        rep = check(store.layout, fix=True)
        assert [(f.kind, f.path) for f in rep.findings] == [("corrupt_origin", str(org))] and rep.fixed == 1
        assert f"holds {have} of 4 rows" in rep.findings[0].detail
        assert f"{4 - have} row(s) written as origin lost" in rep.findings[0].detail
        assert check(store.layout).findings == []
    rows = np.fromfile(org, ORIGIN_DTYPE)
    assert rows["offset"][:have].tolist() == [500 + i for i in range(have)]
    assert rows["queue"][have:].tolist() == [LOST_QUEUE] * (4 - have) and good_rows(rows).all()


def test_check_reports_no_finding_for_a_part_without_an_origin_sidecar(tmp_path: Path) -> None:
    # backfilled parts and parts written before the sidecar existed have none, by design
    org = _one_part_stored(tmp_path, 4)
    org.unlink()
    with ScheduleStore(tmp_path) as store:
        assert check(store.layout).findings == []


@pytest.mark.parametrize("when", MOMENTS)
def test_a_live_parts_origin_sidecar_deleted_between_two_appends_never_misattributes(
        tmp_path: Path, when: str) -> None:
    # the writer keeps a live part's files open, and closes them once more parts were written since than
    # it keeps open (opening them again at the part's next write): the rows after the deletion must stay
    # with their records, and the rows before it are kept as long as the writer held them
    store = ScheduleStore(tmp_path)
    try:
        first, second = _records(5), _records(3, 5)
        store.append(first, T0, [("b:0", 100 + i) for i in range(5)])
        (org,) = list(tmp_path.glob("schedule/*/*.org"))
        delete_under_writer(store, org, when, T0)
        store.append(second, T0, [("b:0", 200 + i) for i in range(3)])
        ids = [r.msg_id for r in first + second]
        want = [("b:0", 100 + i) for i in range(5)] + [("b:0", 200 + i) for i in range(3)]
        got = _origins_of(store, ids)
        # held open, the deleted sidecar still has its rows: they are kept; closed, they are gone, and
        # read as lost, never as another record's
        assert got == (["lost"] * 5 + want[5:] if when == "while-closed" else want)
    finally:
        store.close()
    with ScheduleStore(tmp_path) as again:
        assert _origins_of(again, ids) == got
        assert [f for f in check(again.layout).findings if f.path == str(org)] == []


def test_rows_written_as_lost_are_counted_by_recovery_and_by_the_writer(tmp_path: Path) -> None:
    # the log's warning was the only trace: an operator could not tell why a standby held records
    ids = _stored_then_crashed(tmp_path / "crashed")
    (org,) = list((tmp_path / "crashed").glob("schedule/*/*.org"))
    os.truncate(org, 2 * ORIGIN_ROW_SIZE)  # the page cache lost four of the six rows
    with ScheduleStore(tmp_path / "crashed") as again:
        assert again.recovery.origin_rows_lost == 4
        assert again.writer.origin_rows_lost == 0
        assert _origins_of(again, ids)[2:] == ["lost"] * 4
    with ScheduleStore(tmp_path / "crashed") as reopened:  # written back whole: nothing more to write
        assert reopened.recovery.origin_rows_lost == 0
    with ScheduleStore(tmp_path / "closed") as store:
        store.append(_records(5), T0, [("b:0", 100 + i) for i in range(5)])
        (org,) = list((tmp_path / "closed").glob("schedule/*/*.org"))
        delete_under_writer(store, org, "while-closed", T0)
        store.append(_records(3, 5), T0, [("b:0", 200 + i) for i in range(3)])
        assert store.writer.origin_rows_lost == 5
