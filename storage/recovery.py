"""Recovery on open: replay the ingest log since the last checkpoint, then check part tails.

Cost is proportional to what needs it: the frames written since the last checkpoint (bounded by
`checkpoint_bytes`), plus one stat per part of the segments not yet fully dispatched; only a tail
that disagrees with its index is scanned.
"""
from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np

from storage._files import size_of, write_all
from storage._leftovers import settle_part
from storage.index import INDEX_ENTRY_SIZE, index_entries, read_index
from storage.layout import SegmentLayout
from storage.origin import ORIGIN_ROW_SIZE, align_rows
from storage.part import repair_part
from storage.record import decode
from storage.retention import finish_removals

if TYPE_CHECKING:
    from storage.store import ScheduleStore


@dataclass(slots=True)
class RecoveryReport:
    """What opening the store found and repaired."""

    replayed_frames: int = 0
    replayed_records: int = 0
    ingest_bytes_cut: int = 0
    ingest_frames_skipped: int = 0
    parts_checked: int = 0
    parts_repaired: int = 0
    index_entries_added: int = 0
    index_entries_dropped: int = 0
    log_bytes_cut: int = 0
    #: origin sidecar rows written as lost (rows an OS crash took, or of entries an index repair dropped)
    origin_rows_lost: int = 0
    findings: list[str] = field(default_factory=list)


def recover(store: "ScheduleStore") -> RecoveryReport:
    """Bring parts, indexes and the meta store back to what was acknowledged."""
    rep = RecoveryReport()
    for name in finish_removals(store):
        rep.findings.append(f"retiring/{name}: a retirement a crash interrupted; its deletion was finished")
    cp = store.meta.get_document("checkpoint") or {"seq": 0, "pos": 0}
    wal = store._wal
    by_part: dict[tuple[int, int], list[tuple[np.ndarray, memoryview]]] = defaultdict(list)
    last_seq, last_end = cp["seq"], cp["pos"]
    wal.skipped.clear()
    for frame in wal.frames(cp["seq"], cp["pos"]):
        rep.replayed_frames += 1
        rep.replayed_records += len(frame.locations)
        starts = np.concatenate(([0], np.cumsum(frame.locations["length"].astype(np.int64))))
        for i, loc in enumerate(frame.locations):
            by_part[(int(loc["segment_ms"]), int(loc["part"]))].append(
                (loc, frame.records[starts[i]:starts[i + 1]]))
        last_seq, last_end = frame.seq, frame.end
    for seq, pos, n in wal.skipped:
        rep.ingest_frames_skipped += 1
        rep.findings.append(f"ingest log {seq:012d}.wal: {n} corrupt bytes at {pos} skipped; the frames after "
                            f"them were replayed (the records of the bad frame are kept where the part holds them)")
    for seq in wal.sequences():
        if seq < last_seq:
            continue
        path = wal.dir / f"{seq:012d}.wal"
        valid = last_end if seq == last_seq else (0 if seq > last_seq else size_of(path))
        cut = size_of(path) - valid
        if cut > 0:
            rep.ingest_bytes_cut += cut
            rep.findings.append(f"ingest log {path.name}: torn tail of {cut} bytes cut (never acknowledged)")
            os.truncate(path, valid)
    ids, segs, parts, offs, keys = [], [], [], [], []
    for (seg, part), items in by_part.items():
        _replay_part(store, seg, part, items, rep)
        for loc, blob in items:
            rec, _ = decode(blob)
            ids.append(rec.msg_id)
            segs.append(seg)
            parts.append(part)
            offs.append(int(loc["offset"]))
            keys.append(rec.keys)
    if ids:
        store.meta.put_records(ids, segs, parts, offs, keys)
    done = store.meta.done_segments()
    tails = repair_all_parts(store.layout, [s for s in store.layout.list_segments() if s not in done])
    rep.parts_checked = tails.parts_checked
    rep.parts_repaired = tails.parts_repaired
    rep.index_entries_added = tails.index_entries_added
    rep.index_entries_dropped = tails.index_entries_dropped
    rep.log_bytes_cut = tails.log_bytes_cut
    rep.origin_rows_lost += tails.origin_rows_lost
    rep.findings.extend(tails.findings)
    return rep


def _replay_part(store: "ScheduleStore", seg: int, part: int, items: list[tuple[np.ndarray, memoryview]],
                 rep: "RecoveryReport") -> None:
    """Rewrite a part from its first replayed offset on: idempotent, whatever the crash left."""
    log_path = store.layout.part_log(seg, part)
    idx_path = store.layout.part_index(seg, part)
    # before the sidecars are read and written (a missing one made): a copy a crash left may be the
    # part's only origin rows (`storage._leftovers`)
    rep.findings.extend(settle_part(log_path))
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # the part may be new, and so may its segment directory, even when the directory is there: a
    # process killed before its checkpoint left it in the page cache, its name not yet durable. The
    # checkpoint after recovery lets the ingest log go, so it makes both names durable first.
    store.writer.new_dirs.update((log_path.parent, store.layout.schedule_dir))
    first = min(int(loc["offset"]) for loc, _ in items)
    end = max(int(loc["offset"]) + int(loc["length"]) for loc, _ in items)
    size = size_of(log_path)
    if size < first:
        rep.findings.append(f"part {log_path}: {size} bytes on disk but the ingest log starts at {first}; "
                            "bytes before the last checkpoint are missing (disk loss?)")
    idx = read_index(idx_path)
    keep = int(np.searchsorted(idx["offset"], first)) if len(idx) else 0
    locs = np.array([loc for loc, _ in items])
    # Each record goes back at its own offset: when a bad ingest frame was skipped, its records stay
    # as the part holds them (their index entries too), between the replayed ones.
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        if _contiguous(locs):
            os.ftruncate(fd, first)
        for loc, blob in items:
            os.lseek(fd, int(loc["offset"]), os.SEEK_SET)
            write_all(fd, blob)
        os.ftruncate(fd, end)
    finally:
        os.close(fd)
    replayed = index_entries(locs["due_ms"], locs["offset"], locs["length"])
    between = idx[keep:]
    between = between[(between["offset"] < end) & ~np.isin(between["offset"], replayed["offset"])]
    new_idx = np.sort(np.concatenate([between, replayed]), order="offset") if len(between) else replayed
    # the origin rows of these records, where the crash left them, still belong to them (same
    # records, same order); rows past them would misalign the sidecar
    rep.origin_rows_lost += _mend_origins(store.layout.part_origin(seg, part), keep + len(new_idx))
    fd = os.open(idx_path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.ftruncate(fd, keep * INDEX_ENTRY_SIZE)
        os.lseek(fd, keep * INDEX_ENTRY_SIZE, os.SEEK_SET)
        write_all(fd, new_idx.tobytes())
    finally:
        os.close(fd)
    store.writer.dirty.add((seg, part))


def _mend_origins(org_path: Path, rows: int) -> int:
    """Make a replayed part's origin sidecar exactly `rows` rows long: rows past them are cut; rows an
    OS crash took (the file short, or gone) are written back as lost (`storage.origin.LOST_QUEUE`), as
    the ingest log holds no origins. They stay lost whatever reads them; a sidecar left gone would read
    as unknown, which a replica set judges by its watermark alone: a record that reached this replica
    late would pass for one the holder sent. Returns how many rows were written as lost."""
    if size_of(org_path) == rows * ORIGIN_ROW_SIZE:
        return 0
    fd = os.open(org_path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        return align_rows(fd, rows)
    finally:
        os.close(fd)


def _contiguous(locs: np.ndarray) -> bool:
    """Whether the replayed records follow one another with no gap (no bad frame skipped among them)."""
    order = np.argsort(locs["offset"], kind="stable")
    off, length = locs["offset"][order].astype(np.int64), locs["length"][order].astype(np.int64)
    return bool(np.all(off[1:] == off[:-1] + length[:-1]))


def repair_all_parts(layout: SegmentLayout, segments: Sequence[int] | None = None) -> RecoveryReport:
    """Check every part's tail against its index (cost: one stat per part and two of its sidecars'
    copies a crash may have left, `storage._leftovers`, settled first; a scan only of tails)."""
    rep = RecoveryReport()
    for seg in layout.list_segments() if segments is None else segments:
        for part in layout.list_parts(seg):
            rep.parts_checked += 1
            rep.findings.extend(settle_part(layout.part_log(seg, part)))
            pr = repair_part(layout.part_log(seg, part), layout.part_index(seg, part))
            rep.origin_rows_lost += pr.origin_rows_lost
            if pr.changed:
                rep.parts_repaired += 1
                rep.index_entries_added += pr.index_added
                rep.index_entries_dropped += pr.index_dropped
                rep.log_bytes_cut += pr.log_bytes_cut
                what = [f"{k}={v}" for k, v in (("rebuilt", pr.index_rebuilt), ("indexed", pr.index_added),
                                                  ("dropped", pr.index_dropped), ("cut_bytes", pr.log_bytes_cut),
                                                  ("damaged", pr.damaged))
                        if v]
                why = "; ".join(r for r in (pr.bad_index, pr.reason) if r)
                rep.findings.append(f"part {layout.part_log(seg, part)}: repaired ({', '.join(what)})"
                                    + (f": {why}" if why else ""))
    return rep
