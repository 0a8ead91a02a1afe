"""The write path's files: each segment's live part, its descriptors, and what a checkpoint must fsync.

A segment's new records go to its live part in order; a part is claimed with O_EXCL
(`SegmentLayout.claim_part`) and rolled at `max_part_bytes`. A commit writes each touched part
once for its records, then once for their index entries, so an index entry never points past its
record. A failed commit is cut back to its undo point: a torn record would hide later ones. The
writer holds each part's lock while it has the part open (`storage.part.still_part`).
"""
from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from storage._dispatch_writer import LOCK_WAIT_S
from storage._files import lock_exclusive, remake, write_all
from storage._leftovers import settle_part
from storage.errors import StorageWriteError
from storage.index import INDEX_DTYPE, INDEX_ENTRY_SIZE, index_entries
from storage.ingest_log import LOCATION_DTYPE
from storage.layout import SegmentLayout
from storage.origin import ORIGIN_ROW_SIZE, align_rows
from storage.part import UNSAFE_WITHOUT_PART_LOCKS, repair_part

log = logging.getLogger("timewheel.storage")
#: parts whose three descriptors stay open at most (the least recently written closes first); a
#: sealed or retired segment's close at once: a deleted file held open keeps its disk space
_MAX_OPEN_FDS = 128
#: from this many records a batch is placed with array operations (fewer: a loop costs less)
_ARRAY_PLACE_MIN = 32
#: where every live part ends: segment -> (part, bytes, entries)
UndoPoint = dict[int, tuple[int, int, int]]
#: a part's descriptors, in this order: records, index, origins
_INDEX, _ORIGIN = 1, 2


@dataclass(slots=True)
class _LivePart:
    segment_ms: int
    part: int
    size: int
    entries: int


@dataclass(frozen=True, slots=True)
class Unsynced:
    """What a checkpoint must fsync: duplicated descriptors, files by path, then directories."""

    fds: list[int]
    paths: list[Path]
    dirs: list[Path]


class PartWriter:
    """Places records in live parts and writes them; the caller holds the store's write lock."""

    def __init__(self, layout: SegmentLayout, max_part_bytes: int) -> None:
        self.layout = layout
        self.max_part_bytes = max_part_bytes
        self.live: dict[int, _LivePart] = {}
        self._fds: OrderedDict[tuple[int, int], tuple[int, int, int]] = OrderedDict()
        #: parts written since the last checkpoint
        self.dirty: set[tuple[int, int]] = set()
        #: the ingest log file written with these parts now (the store sets it), and per segment the
        #: one its last write went with: what a crash would replay into it
        self.log_seq = 0
        self.log_seq_of: dict[int, int] = {}
        #: directories that gained a name since the last checkpoint (new parts, new segments)
        self.new_dirs: set[Path] = set()
        #: origin sidecar rows this writer wrote as lost (a sidecar deleted or cut while its part was closed,
        #: or an index indexed again), so that each later row stays with its record
        self.origin_rows_lost = 0

    def place(self, dues: list[int], blobs: list[bytes]) -> np.ndarray:
        """Give each new record its segment, part and offset (LOCATION_DTYPE): a segment's records go
        to its live part in order. A batch of one segment that fits its live part (the usual
        commit under load) is placed with a few array operations; any other record by record."""
        seg_size = self.layout.segment_ms
        n = len(blobs)
        written = np.zeros(n, LOCATION_DTYPE)
        if not n:
            return written
        if n >= _ARRAY_PLACE_MIN:
            due = np.asarray(dues, np.int64)
            seg = int(due[0] - due[0] % seg_size)
            if ((due - due % seg_size) == seg).all():
                if self._place_in_live_part(seg, due, blobs, written):
                    return written
        segs, parts, offs, lens_ = [], [], [], []
        live_of: dict[int, _LivePart] = {}
        for d, blob in zip(dues, blobs):
            sg = d - d % seg_size
            ln = len(blob)
            lp = live_of.get(sg)
            if lp is None or lp.size + ln > self.max_part_bytes:
                lp = live_of[sg] = self._live_part(sg, ln)
            segs.append(sg)
            parts.append(lp.part)
            offs.append(lp.size)
            lens_.append(ln)
            lp.size += ln
            lp.entries += 1
        written["segment_ms"] = segs
        written["due_ms"] = dues
        written["part"] = parts
        written["offset"] = offs
        written["length"] = lens_
        return written

    def _place_in_live_part(self, seg: int, due: np.ndarray, blobs: list[bytes], written: np.ndarray) -> bool:
        """Place a batch of one segment in its live part if the part is open and holds it all."""
        n = len(blobs)
        lens = np.fromiter(map(len, blobs), np.int64, n)
        live = self.live.get(seg)
        total = int(lens.sum())
        if live is None or live.size + total > self.max_part_bytes:
            return False
        ends = np.cumsum(lens)
        written["segment_ms"] = seg
        written["due_ms"] = due
        written["part"] = live.part
        written["offset"] = live.size + ends - lens
        written["length"] = lens
        live.size += total
        live.entries += n
        return True

    def _live_part(self, segment_ms: int, need: int) -> _LivePart:
        live = self.live.get(segment_ms)
        if live is None or live.size + need > self.max_part_bytes:
            part = self.layout.claim_part(segment_ms)  # its record file and both sidecars, empty
            self.new_dirs.update((self.layout.segment_dir(segment_ms), self.layout.schedule_dir))
            live = _LivePart(segment_ms, part, 0, 0)
            self.live[segment_ms] = live
        return live

    def _part_fds(self, segment_ms: int, part: int) -> tuple[int, int, int]:
        key = (segment_ms, part)
        fds = self._fds.get(key)
        if fds is not None:
            self._fds.move_to_end(key)
            return fds
        opened: list[int] = []
        log_path = self.layout.part_log(segment_ms, part)
        try:
            opened.append(os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644))
            # held until the descriptor closes: one flock a part opened, none a commit. `check(fix=True)`
            # repairs no part whose lock it cannot take, so its cuts and index entries never land
            # between this writer's record, origin and index writes (`storage.part.still_part`)
            lock_exclusive(opened[0], log_path, UNSAFE_WITHOUT_PART_LOCKS, LOCK_WAIT_S)
            # before a missing sidecar is made, empty: a copy a crash left may hold the part's only
            # origin rows (`storage._leftovers`); under the lock, as `check(fix=True)` settles it
            for settled in settle_part(log_path):
                log.warning("%s", settled)
            # the sidecars readable too: one deleted while open is made again from what it holds (`_file`)
            for path in (self.layout.part_index(segment_ms, part), self.layout.part_origin(segment_ms, part)):
                opened.append(os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644))
            self._index_whole(segment_ms, part, opened[0], opened[1])
        except OSError as e:  # the files opened before the one that failed (EMFILE, ENOSPC) are held by nobody
            for fd in opened:
                os.close(fd)
            if isinstance(e, TimeoutError):
                raise StorageWriteError(f"could not lock {log_path} to append to it: {e}; `fuser {log_path}` "
                                        "names the processes that have it open") from e
            raise
        fds = (opened[0], opened[1], opened[2])
        self._fds[key] = fds
        if len(self._fds) > _MAX_OPEN_FDS:
            self._close_part(next(iter(self._fds)))
        return fds

    def _index_whole(self, segment_ms: int, part: int, log_fd: int, idx_fd: int) -> None:
        """Make sure a part opened to append has its index end where its records end. An index deleted
        (or cut) while the part was closed (its descriptors are opened again: `_MAX_OPEN_FDS`) would
        otherwise hold only the entries written from now on: readers would scan its records instead
        (`storage.part.trusted_index`), but the origins of the part, found through it, would read as
        unknown. So the missing entries are indexed again from the records (`repair_part`, as recovery
        does), the origin sidecar keeping its rows (written in step with the records); a log that
        cannot be indexed to its end without cutting it is refused (the commit fails, nothing kept)."""
        log_size, idx_size = os.fstat(log_fd).st_size, os.fstat(idx_fd).st_size
        end = 0
        if idx_size >= INDEX_ENTRY_SIZE:
            at = idx_size - idx_size % INDEX_ENTRY_SIZE - INDEX_ENTRY_SIZE
            last = np.frombuffer(os.pread(idx_fd, INDEX_ENTRY_SIZE, at), INDEX_DTYPE)[0]
            end = int(last["offset"]) + int(last["length"])
        if end == log_size and not idx_size % INDEX_ENTRY_SIZE:
            return
        log_path, idx_path = self.layout.part_log(segment_ms, part), self.layout.part_index(segment_ms, part)
        plan = repair_part(log_path, idx_path, fix=False)
        if plan.log_bytes_cut or plan.index_dropped or plan.index_rebuilt:
            raise StorageWriteError(
                f"the index {idx_path} ends at byte {end} of the {log_size} of {log_path}, and the records past it "
                f"cannot all be indexed ({plan.bad_index or plan.reason or 'index missing'}): nothing is appended to "
                "the part; restart the engine: its recovery repairs the part (as `storage.check(layout, fix=True)` does)")
        self.origin_rows_lost += repair_part(log_path, idx_path).origin_rows_lost
        self.new_dirs.add(self.layout.segment_dir(segment_ms))  # its name may be new (O_CREAT above)
        log.warning("index %s ended at byte %d of the %d of its records (deleted or cut while its part was closed): "
                    "%d entr(ies) indexed again from the records", idx_path, end, log_size, plan.index_added)

    def _file(self, key: tuple[int, int], which: int) -> tuple[int, os.stat_result]:
        """A part's index or origin descriptor (`which`) and its stat; a file deleted while the writer had
        it open (by hand, by a cleaner) is first made again at its path with all it holds (`remake`):
        appended to as it was, what it holds and every later write would reach no reader, and be freed
        at its close."""
        fds = self._fds[key]
        st = os.fstat(fds[which])
        if st.st_nlink:
            return fds[which], st
        path = (self.layout.part_index if which == _INDEX else self.layout.part_origin)(*key)
        fd = remake(fds[which], path)
        os.close(fds[which])
        self._fds[key] = (fds[0], fd, fds[2]) if which == _INDEX else (fds[0], fds[1], fd)
        self.new_dirs.add(self.layout.segment_dir(key[0]))  # a name made again is made durable too
        st = os.fstat(fd)
        log.warning("%s was deleted while its part was open to append: made again with the %d byte(s) it held",
                    path, st.st_size)
        return fd, st

    def _close_part(self, key: tuple[int, int], keep: bool = True) -> None:
        """Close a part's descriptors; with `keep`, a sidecar deleted under them is made again first."""
        if keep:
            for which in (_INDEX, _ORIGIN):
                try:
                    self._file(key, which)
                except OSError:
                    log.exception("could not make a deleted sidecar of part %s/%s again", *key)
        for fd in self._fds.pop(key):
            os.close(fd)

    def write(self, locs: np.ndarray, blobs: list[bytes], origins: np.ndarray) -> None:
        """One write of records, one of origins (ORIGIN_DTYPE rows) and one of index entries per
        touched part; the origins go before the index, so an index entry always has its origin row
        unless the machine lost the page cache."""
        if not len(locs):
            return
        segs, parts = locs["segment_ms"], locs["part"]
        index = index_entries(locs["due_ms"], locs["offset"], locs["length"])
        org = np.ascontiguousarray(origins)
        if (segs == segs[0]).all() and (parts == parts[0]).all():  # the usual commit: one part
            self._write_part(int(segs[0]), int(parts[0]), b"".join(blobs), org.tobytes(), index.tobytes())
            return
        order = np.lexsort((parts, segs))  # stable: a part's records stay in their order
        s, p = segs[order], parts[order]
        cut = np.flatnonzero((s[1:] != s[:-1]) | (p[1:] != p[:-1])) + 1
        for rows in np.split(order, cut):
            first = int(rows[0])
            self._write_part(int(segs[first]), int(parts[first]), b"".join([blobs[i] for i in rows.tolist()]),
                             org[rows].tobytes(), index[rows].tobytes())

    def _write_part(self, segment_ms: int, part: int, records: bytes, origins: bytes, index: bytes) -> None:
        log_fd = self._part_fds(segment_ms, part)[0]
        idx_fd, idx_st = self._file((segment_ms, part), _INDEX)
        org_fd = self._origin_fd(segment_ms, part, idx_st.st_size // INDEX_ENTRY_SIZE)
        write_all(log_fd, records)
        write_all(org_fd, origins)
        write_all(idx_fd, index)
        self.dirty.add((segment_ms, part))
        self.log_seq_of[segment_ms] = self.log_seq

    def _origin_fd(self, segment_ms: int, part: int, rows: int) -> int:
        """The part's origin sidecar, open, holding one row per entry of its index (`rows`): where this
        commit's rows go. Its descriptors stay open while the part is written (`_part_fds`), so a sidecar
        deleted under the writer (by hand, by a cleaner) would take every later row with it, and the one
        made again when the descriptors are opened again would get them from row 0: each an origin of
        another record. One deleted while still open is made again with the rows it held (`_file`); the
        rows a sidecar still lacks (deleted while its part was closed, or cut) are written as lost
        (queue -2), the reading recovery gives rows an OS crash took: the records stay stored and
        acknowledged, none is read with another's origin, and a replica set never takes one of them for
        a record its lease holder sent. Stopping the write path instead would leave the part with no
        sidecar, which reads as "origin unknown", judged by the watermark alone (docs/HA.md)."""
        org_fd, st = self._file((segment_ms, part), _ORIGIN)
        if st.st_size != rows * ORIGIN_ROW_SIZE:
            path = self.layout.part_origin(segment_ms, part)
            lost = align_rows(org_fd, rows)
            self.origin_rows_lost += lost
            self.new_dirs.add(self.layout.segment_dir(segment_ms))  # a name made again is made durable too
            log.warning("origin sidecar %s held %d bytes for the %d record(s) of its part (deleted or cut under "
                        "its writer): %d row(s) written as origin lost, so that each later row stays with its "
                        "record", path, st.st_size, rows, lost)
        return org_fd

    def undo_point(self) -> UndoPoint:
        """Where every live part ends now, to return to if a commit fails."""
        return {seg: (lp.part, lp.size, lp.entries) for seg, lp in self.live.items()}

    def roll_back(self, undo: UndoPoint) -> None:
        """Cut every live part back to `undo` (parts claimed since are emptied)."""
        for seg, lp in list(self.live.items()):
            part, size, entries = undo.get(seg, (lp.part, 0, 0))
            for p in {part, lp.part}:
                end_size, end_entries = (size, entries) if p == part else (0, 0)
                try:
                    if self.layout.part_log(seg, p).exists():
                        os.truncate(self.layout.part_log(seg, p), end_size)
                        os.truncate(self.layout.part_index(seg, p), end_entries * INDEX_ENTRY_SIZE)
                        if self.layout.part_origin(seg, p).exists():
                            os.truncate(self.layout.part_origin(seg, p), end_entries * ORIGIN_ROW_SIZE)
                except OSError:
                    log.exception("could not cut part %s/%s back after a failed write", seg, p)
            if seg in undo:
                lp.part, lp.size, lp.entries = part, size, entries
            else:
                del self.live[seg]

    def take_unsynced(self) -> Unsynced:
        """What was written since the last call, for a checkpoint to fsync (descriptors duplicated,
        so the fsyncs can run outside the write lock)."""
        fds: list[int] = []
        paths: list[Path] = []
        for seg, part in self.dirty:
            open_fds = self._fds.get((seg, part))
            if open_fds is not None:
                fds.extend(os.dup(fd) for fd in open_fds)
            else:
                paths += [self.layout.part_log(seg, part), self.layout.part_index(seg, part)]
                if self.layout.part_origin(seg, part).exists():
                    paths.append(self.layout.part_origin(seg, part))
        dirs = sorted(self.new_dirs, key=lambda d: len(d.parts), reverse=True)  # children first
        self.dirty, self.new_dirs = set(), set()
        return Unsynced(fds, paths, dirs)

    def seal(self, before_ms: int) -> None:
        """Stop appending to live parts of segments that end at or before `before_ms`, and close
        the descriptors of those segments' parts (one written again opens them again; one written
        since the last checkpoint is fsynced by its path)."""
        for seg in [s for s in self.live if s + self.layout.segment_ms <= before_ms]:
            del self.live[seg]
        self._close_where(lambda seg: seg + self.layout.segment_ms <= before_ms)

    def forget(self, segment_ms: int) -> None:
        """Close a segment's descriptors and forget its unsynced parts: it is being retired."""
        self.live.pop(segment_ms, None)
        self.log_seq_of.pop(segment_ms, None)
        self._close_where(lambda seg: seg == segment_ms, keep=False)  # its files are on their way out
        self.dirty = {(seg, part) for seg, part in self.dirty if seg != segment_ms}

    def _close_where(self, of_segment: Callable[[int], bool], keep: bool = True) -> None:
        """Close the descriptors of every part of the segments `of_segment` picks (`_close_part`)."""
        for key in [k for k in self._fds if of_segment(k[0])]:
            self._close_part(key, keep)

    def close(self) -> None:
        """Close every descriptor."""
        for key in list(self._fds):
            self._close_part(key)
