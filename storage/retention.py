"""Retention: segments whose every record is done leave the data directory (or go to archive/).

The meta store's entries of a retired segment's records go first (ids' locations, business keys,
cancel marks), so the id and key indexes hold only what the data directory holds: they stay bounded
by retention, and a look-up never points at files that are gone. An id stored again in a later
segment (its location is there) keeps its entries. When the move is then refused (below), the
segment stays and so do its records: what was forgotten is given back, read again from the
segment, or a look-up by id or key would not find them until a later retirement.

A deleted segment is first moved whole to retiring/, then its files go: a crash midway never
leaves part of a segment behind in schedule/ (the next open finishes the deletion). The move is
made under the store's write lock, and only if no file of the segment changed since retention read
it: a message that arrives long past due is stored in the old segment of its due time, and must not
be deleted with the records retention found done. Nor is a segment retired while one of its records
is still in the ingest log past the last checkpoint: a crash would replay it into a new copy of the
segment, pending, and it would be sent again. The segment's done mark goes just before the move, synced
(and so are the entries forgotten before it): a mark that outlived the directory (a crash after the
move, a power loss before the meta store's next flush) would name the part numbers, from 0, of a part
published later into the hour made again, and that part would be taken for sent, never loaded.

An old segment still pending (a record retrying for days, say) is read again only once one of its
files has changed since it was last found pending, not at every checkpoint: its index and dispatch
log can be gigabytes.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import numpy as np

from storage._files import fsync_path
from storage.audit import summarize_segment
from storage.layout import PART_LOG_SUFFIX, parse_segment_name, part_name

if TYPE_CHECKING:
    from storage.store import ScheduleStore


def retire(store: "ScheduleStore", now_ms: int, min_age_ms: int, *, archive: bool = False) -> list[int]:
    """Remove (or move to archive/) segments that ended at least `min_age_ms` ago and whose every
    record was dispatched, dead-lettered, cancelled or found corrupt; never others."""
    layout = store.layout
    retired = []
    for seg in layout.list_segments():
        if seg + layout.segment_ms + min_age_ms > now_ms:
            break
        if store.is_live(seg):
            continue
        seg_dir = layout.segment_dir(seg)
        files = _files(seg_dir)  # before it is read: what the decision below is about
        if store.pending_old.get(seg) == files:
            continue  # pending when last read, and not written since: no outcome can have changed
        if not store.checkpointed(seg):
            continue  # a crash would replay a record into it from the ingest log: decided next time
        if summarize_segment(layout, seg).pending:
            store.pending_old[seg] = files
            continue
        store.pending_old.pop(seg, None)
        forgotten = forget_segment_records(store, seg, dict(files))
        # a message long past due is stored in the old segment of its due time: if one came in since
        # `files` was taken, the segment stays (decided again at the next checkpoint)
        holder = layout.archive_dir if archive else layout.retiring_dir
        if not holder.is_dir():
            holder.mkdir(parents=True, exist_ok=True)
            fsync_path(layout.root)  # the new archive/ (or retiring/) itself survives a power loss
        dst = holder / seg_dir.name
        if dst.exists() and not archive:  # the same segment's leftover (stored to again since)
            shutil.rmtree(dst)
        n = 0
        while dst.exists():  # archived before, then stored to again: both kept, side by side
            n += 1
            dst = holder / f"{seg_dir.name}.{n}"
        if not store.take_out_segment(seg, lambda: _files(seg_dir) == files, dst):
            # the segment stays, and its records with it: a look-up must go on finding them
            put_back_segment_records(store, seg, forgotten)
            continue
        if archive:
            fsync_path(holder)  # in archive/ for good: the archived copy outlives a power loss
        else:
            shutil.rmtree(dst)
        retired.append(seg)
    return retired


def finish_removals(store: "ScheduleStore") -> list[str]:
    """Delete what a retirement interrupted by a crash left in retiring/ (at open); returns their names."""
    retiring = store.layout.retiring_dir
    if not retiring.is_dir():
        return []
    names = sorted(e.name for e in os.scandir(retiring))
    for name in names:
        path = retiring / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
        seg = parse_segment_name(name)
        if seg is not None:
            store.meta.forget_segment(seg)
    return names


def _files(seg_dir: Path) -> tuple[tuple[str, int], ...]:
    """A segment's files and their sizes: what changes when anything is written to it (each file is
    only ever appended to, or cut by a repair)."""
    try:
        return tuple(sorted((e.name, e.stat().st_size) for e in os.scandir(seg_dir) if e.is_file()))
    except FileNotFoundError:
        return ()


_FORGET_CHUNK = 65_536  # records read and forgotten per write batch at most
#: and record bytes read per batch at most (one larger record goes alone): a batch's records are
#: copied whole into one buffer, so a count alone would hold gigabytes of a segment of large messages
_FORGET_BYTES = 16 << 20


@dataclass(frozen=True, slots=True)
class Forgotten:
    """What `forget_segment_records` dropped: the index rows of the records whose entries went (in
    the index's own widths, 10 bytes a record: held for as long as the move takes, a whole hour's
    records), and the few whose cancel mark went with them (`cancelled` rows, `cancel_at` times)."""

    part: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    cancelled: np.ndarray
    cancel_at: np.ndarray

    def __len__(self) -> int:
        return len(self.part)

    def cancel_times(self, rows: np.ndarray) -> list[int | None]:
        """Each row's cancel time, None for a row that was not cancelled."""
        k = np.searchsorted(self.cancelled, rows)
        hit = k < len(self.cancelled)
        hit[hit] = self.cancelled[k[hit]] == rows[hit]
        out: list[int | None] = [None] * len(rows)
        for i, t in zip(np.flatnonzero(hit).tolist(), self.cancel_at[k[hit]].tolist()):
            out[i] = t
        return out


def forget_segment_records(store: "ScheduleStore", segment_ms: int, sizes: dict[str, int] | None = None) -> Forgotten:
    """Drop the meta store's entries of a segment's records (those whose location is this segment);
    returns what was forgotten, to put back with `put_back_segment_records` if the segment stays.
    Records that cannot be read are left (nothing names them). With `sizes` (file name -> bytes, as
    the caller found them), only the records those bytes held: one stored since is not forgotten."""
    ix = store.segment_index(segment_ms)
    part, offset, length = ix.part, ix.offset, ix.length
    if sizes is not None:  # per part: the log's size then (parts are append-only; a new part had none)
        parts_then = int(part.max()) + 1 if len(part) else 0
        held = np.array([sizes.get(part_name(p) + PART_LOG_SUFFIX, 0) for p in range(parts_then)], np.int64)
        keep = offset.astype(np.int64) + length <= held[part] if len(part) else np.ones(0, bool)
        part, offset, length = part[keep], offset[keep], length[keep]
    rows: list[np.ndarray] = [np.zeros(0, np.int64)]
    cancelled: list[int] = []
    cancel_at: list[int] = []
    taken = 0
    for at, ids, keys in _readable(store, segment_ms, part, offset, length):
        here = [k for k, loc in enumerate(store.meta.locations(ids)) if loc is not None and loc.segment_ms == segment_ms]
        dropped = store.meta.forget_records([ids[k] for k in here], [keys[k] for k in here])
        rows.append(at[here])
        for j, t in enumerate(dropped):
            if t is not None:
                cancelled.append(taken + j)
                cancel_at.append(t)
        taken += len(here)
    took = np.concatenate(rows)
    return Forgotten(part[took], offset[took], length[took], np.array(cancelled, np.int64),
                     np.array(cancel_at, np.int64))


def put_back_segment_records(store: "ScheduleStore", segment_ms: int, forgotten: Forgotten) -> int:
    """Give back the meta store's entries that `forget_segment_records` dropped of a segment that
    stays; an id stored again since keeps its new entries. Returns how many were given back."""
    back = 0
    for at, ids, keys in _readable(store, segment_ms, forgotten.part, forgotten.offset, forgotten.length):
        back += store.put_back_records(segment_ms, ids, forgotten.part[at].tolist(), forgotten.offset[at].tolist(),
                                       keys, forgotten.cancel_times(at))
    return back


def _readable(store: "ScheduleStore", segment_ms: int, part: np.ndarray, offset: np.ndarray,
              length: np.ndarray) -> Iterator[tuple[np.ndarray, list[str], list[tuple[str, ...]]]]:
    """The readable ones of a segment's records (rows of the arrays given), batch by batch: their
    rows, ids and business keys."""
    ends = np.cumsum(length, dtype=np.int64)
    start = 0
    while start < len(part):
        budget = (int(ends[start - 1]) if start else 0) + _FORGET_BYTES
        stop = min(max(int(np.searchsorted(ends, budget, side="right")), start + 1), start + _FORGET_CHUNK, len(part))
        raw = store.read_record_bytes(np.full(stop - start, segment_ms, np.int64), part[start:stop], offset[start:stop])
        good = np.flatnonzero(raw.ok)
        ids, keys = raw.select(good).ids_and_keys()  # no object made of a body
        del raw
        yield start + good, ids, keys
        start = stop
