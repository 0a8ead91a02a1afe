"""The schedule store: appends with group commit, recovery on open, reads, dispatch records.

Write path of one group commit (many callers' batches merged into one):
  1. dedup: ids already stored (meta store) or repeated in the batch are not written again;
  2. the whole batch goes to the ingest log as one frame (one write; one fsync with flush="sync");
  3. each touched segment's live part gets one write of records and one of index entries;
  4. ids and business keys go to the meta store in one write batch.
A crash anywhere in 2-4 is repaired on open by replaying the ingest log from the last checkpoint.
A checkpoint fsyncs the parts written since the previous one and lets older log files go, so a
restart replays at most `checkpoint_bytes` of frames, whatever the backlog.
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal, Sequence

import numpy as np

from storage import dispatch as _dispatch
from storage._files import fsync_path, size_of, write_all
from storage.errors import CorruptRecordError, DelayTooLongError, StorageWriteError, StoreClosedError
from storage.index import INDEX_DTYPE, MAX_PART_BYTES, read_index
from storage.ingest_log import LOCATION_DTYPE, IngestLog
from storage.layout import SegmentLayout
from storage.meta import MetaStore
from storage.part import PartReader, repair_part, trusted_index
from storage.record import HEADER_SIZE, Record, decode, encode, record_length

log = logging.getLogger("timewheel.storage")
FlushPolicy = Literal["async", "sync"]
TWO_YEARS_MS = 17_568 * 3_600_000
_MAX_OPEN_FDS = 128


@dataclass(frozen=True, slots=True)
class AppendResult:
    """Outcome of an append: per input record, its location and whether it was newly stored."""

    msg_ids: list[str]
    locations: np.ndarray  # LOCATION_DTYPE; for duplicates, where the first copy lives (due_ms/length 0)
    new: np.ndarray  # bool

    def __len__(self) -> int:
        return len(self.msg_ids)


@dataclass(slots=True)
class RecoveryReport:
    """What opening the store found and repaired."""

    replayed_frames: int = 0
    replayed_records: int = 0
    ingest_bytes_cut: int = 0
    parts_checked: int = 0
    parts_repaired: int = 0
    index_entries_added: int = 0
    index_entries_dropped: int = 0
    log_bytes_cut: int = 0
    findings: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class SegmentIndex:
    """A segment's index over all its parts, concatenated in (part, offset) order."""

    segment_ms: int
    due_ms: np.ndarray
    part: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    part_ranges: list[tuple[int, int, int]]  # (part, start, end) rows of each part, in order

    def __len__(self) -> int:
        return len(self.due_ms)

    def keys(self) -> np.ndarray:
        """part << 32 | offset: sorted ascending, unique per record."""
        return (self.part.astype(np.uint64) << np.uint64(32)) | self.offset.astype(np.uint64)


@dataclass(slots=True)
class _LivePart:
    segment_ms: int
    part: int
    size: int
    entries: int


@dataclass(slots=True)
class _Pending:
    records: Sequence[Record]
    done: bool = False
    result: AppendResult | None = None
    error: BaseException | None = None


class ScheduleStore:
    """Hourly (configurable) schedule-log segments with an ingest log, dispatch logs and a meta store."""

    def __init__(self, data_dir: str | os.PathLike[str], *, segment_minutes: int = 60,
                 flush: FlushPolicy = "async", max_delay_ms: int = TWO_YEARS_MS,
                 max_part_bytes: int = 1 << 30, checkpoint_bytes: int = 64 << 20) -> None:
        if flush not in ("async", "sync"):
            raise ValueError(f"flush must be 'async' or 'sync', not {flush!r}")
        if not 0 < max_part_bytes <= MAX_PART_BYTES:
            raise ValueError(f"max_part_bytes must be in (0, {MAX_PART_BYTES}]")
        self.layout = SegmentLayout(data_dir, segment_minutes)
        self.flush = flush
        self.max_delay_ms = max_delay_ms
        self.max_part_bytes = max_part_bytes
        self.checkpoint_bytes = checkpoint_bytes
        self.meta = MetaStore(self.layout.meta_dir)
        self._wal = IngestLog(self.layout.ingest_dir)
        self._live: dict[int, _LivePart] = {}
        self._fds: OrderedDict[tuple[int, int], tuple[int, int]] = OrderedDict()
        self._dirty: set[tuple[int, int]] = set()
        self._dispatch_fds: dict[int, int] = {}
        self._dispatch_dirty: set[int] = set()
        self._readers: dict[tuple[int, int], PartReader] = {}
        self._write_lock = threading.Lock()
        self._checkpoint_lock = threading.Lock()
        self._dispatch_lock = threading.Lock()
        self._read_lock = threading.Lock()
        self._cv = threading.Condition()
        self._queue: list[_Pending] = []
        self._committing = False
        self._closed = False
        #: called under the write lock with each commit's new records (LOCATION_DTYPE), in commit
        #: order; a listener must be quick and must not call back into the store's writers
        self.commit_listeners: list[Callable[[np.ndarray], None]] = []
        self._due_checkpoint: tuple[int, list[int], list[Path]] | None = None
        self.corrupt_records_found = 0
        from storage.recovery import recover  # recovery needs the layout and meta built above

        self.recovery: RecoveryReport = recover(self)
        self._checkpoint_locked()

    # ---- append with group commit -------------------------------------------------------------

    def append(self, records: Sequence[Record], now_ms: int) -> AppendResult:
        """Store records durably under the flush policy; repeated ids are stored once.

        Raises DelayTooLongError (nothing written) if any record is due past the maximum delay.
        Concurrent callers are merged into one commit.
        """
        if self._closed:
            raise StoreClosedError("the store is closed")
        for r in records:
            if r.due_ms - now_ms > self.max_delay_ms:
                raise DelayTooLongError(r.due_ms, now_ms, self.max_delay_ms)
        req = _Pending(records)
        with self._cv:
            self._queue.append(req)
            while not req.done:
                if self._committing:
                    self._cv.wait()
                    continue
                self._committing = True
                batch, self._queue = self._queue, []
                self._cv.release()
                try:
                    self._commit(batch, now_ms)
                finally:
                    self._cv.acquire()
                    self._committing = False
                    self._cv.notify_all()
        if req.error is not None:
            raise req.error
        assert req.result is not None
        return req.result

    def _commit(self, batch: list[_Pending], now_ms: int) -> None:
        try:
            with self._write_lock:
                self._commit_locked(batch, now_ms)
                snapshot, self._due_checkpoint = self._due_checkpoint, None
            if snapshot is not None:  # the fsyncs run outside the write lock
                self._finish_checkpoint(snapshot)
        except BaseException as e:  # every waiter learns of the failure
            for req in batch:
                if not req.done:
                    req.error = e
                    req.done = True
            raise

    def _commit_locked(self, batch: list[_Pending], now_ms: int) -> None:
        records = [r for req in batch for r in req.records]
        ids = [r.msg_id for r in records]
        existing = self.meta.locations(ids)
        n = len(records)
        locs = np.zeros(n, LOCATION_DTYPE)
        new = np.zeros(n, bool)
        first_seen: dict[str, int] = {}
        blobs: list[bytes] = []
        new_pos: list[int] = []
        dups: list[tuple[int, int]] = []
        for i, r in enumerate(records):
            loc = existing[i]
            if loc is not None:
                locs[i] = (loc.segment_ms, 0, loc.offset, 0, loc.part, 0, 0)
                continue
            j = first_seen.get(r.msg_id)
            if j is not None:
                dups.append((i, j))
                continue
            first_seen[r.msg_id] = i
            blobs.append(encode(r, r.enqueue_ms or now_ms))
            new_pos.append(i)
        if blobs:
            dues = [records[i].due_ms for i in new_pos]
            undo = self._undo_point()
            written = self._place(dues, blobs)
            pos = np.asarray(new_pos)
            new[pos] = True
            locs[pos] = written
            for i, j in dups:
                locs[i] = locs[j]
            try:
                self._wal.append(written, blobs, now_ms, sync=self.flush == "sync")
                self._write_parts(written, blobs)
            except OSError as e:
                self._roll_back(undo)
                raise StorageWriteError(f"could not store {len(blobs)} records in {self.layout.root}: {e}; "
                                        "nothing of this batch was kept (free disk space, then retry)") from e
            for listener in self.commit_listeners:
                listener(written)
            self.meta.put_records([ids[i] for i in new_pos], written["segment_ms"].tolist(),
                                  written["part"].tolist(), written["offset"].tolist(),
                                  [records[i].keys for i in new_pos])
        start = 0
        for req in batch:
            end = start + len(req.records)
            req.result = AppendResult(ids[start:end], locs[start:end], new[start:end])
            req.done = True
            start = end
        if self._wal.position >= self.checkpoint_bytes:
            self._due_checkpoint = self._rotate_locked()

    def _undo_point(self) -> tuple[int, int, dict[int, tuple[int, int, int]]]:
        """Where the ingest log and every live part end now, to return to if a commit fails."""
        return self._wal.seq, self._wal.position, {seg: (lp.part, lp.size, lp.entries)
                                                    for seg, lp in self._live.items()}

    def _roll_back(self, undo: tuple[int, int, dict[int, tuple[int, int, int]]]) -> None:
        """Cut what a failed commit wrote (a torn frame or record would hide later ones)."""
        seq, pos, live = undo
        try:
            self._wal.truncate(seq, pos)
        except OSError:
            log.exception("could not cut the ingest log back after a failed write")
        for seg, lp in list(self._live.items()):
            part, size, entries = live.get(seg, (lp.part, 0, 0))
            for p in {part, lp.part}:
                end_size, end_entries = (size, entries) if p == part else (0, 0)
                try:
                    if self.layout.part_log(seg, p).exists():
                        os.truncate(self.layout.part_log(seg, p), end_size)
                        os.truncate(self.layout.part_index(seg, p), end_entries * INDEX_DTYPE.itemsize)
                except OSError:
                    log.exception("could not cut part %s/%s back after a failed write", seg, p)
            if seg in live:
                lp.part, lp.size, lp.entries = part, size, entries
            else:
                del self._live[seg]

    def _place(self, dues: list[int], blobs: list[bytes]) -> np.ndarray:
        """Give each new record its segment, part and offset: a segment's records go to its live
        part in order. Plain Python: batches touch many segments with few records each, where
        per-group numpy calls would cost more than they save."""
        seg_size = self.layout.segment_ms
        segs, parts, offs, lens = [], [], [], []
        live_of: dict[int, _LivePart] = {}
        for due, blob in zip(dues, blobs):
            seg = due - due % seg_size
            ln = len(blob)
            live = live_of.get(seg)
            if live is None or live.size + ln > self.max_part_bytes:
                live = live_of[seg] = self._live_part(seg, ln)
            segs.append(seg)
            parts.append(live.part)
            offs.append(live.size)
            lens.append(ln)
            live.size += ln
            live.entries += 1
        written = np.zeros(len(blobs), LOCATION_DTYPE)
        written["segment_ms"] = segs
        written["due_ms"] = dues
        written["part"] = parts
        written["offset"] = offs
        written["length"] = lens
        return written

    def _live_part(self, segment_ms: int, need: int) -> _LivePart:
        live = self._live.get(segment_ms)
        if live is None or live.size + need > self.max_part_bytes:
            part = self.layout.claim_part(segment_ms)
            open(self.layout.part_index(segment_ms, part), "wb").close()
            live = _LivePart(segment_ms, part, 0, 0)
            self._live[segment_ms] = live
        return live

    def _part_fds(self, segment_ms: int, part: int) -> tuple[int, int]:
        key = (segment_ms, part)
        fds = self._fds.get(key)
        if fds is not None:
            self._fds.move_to_end(key)
            return fds
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
        fds = (os.open(self.layout.part_log(segment_ms, part), flags, 0o644),
               os.open(self.layout.part_index(segment_ms, part), flags, 0o644))
        self._fds[key] = fds
        if len(self._fds) > _MAX_OPEN_FDS:
            _, (a, b) = self._fds.popitem(last=False)
            os.close(a)
            os.close(b)
        return fds

    def _write_parts(self, locs: np.ndarray, blobs: list[bytes]) -> None:
        """One write of records and one of index entries per touched part."""
        groups: dict[tuple[int, int], list[int]] = {}
        for i, key in enumerate(zip(locs["segment_ms"].tolist(), locs["part"].tolist())):
            groups.setdefault(key, []).append(i)
        idx_bytes = np.empty(len(locs), INDEX_DTYPE)
        idx_bytes["due_ms"] = locs["due_ms"]
        idx_bytes["offset"] = locs["offset"]
        idx_bytes["length"] = locs["length"]
        raw = idx_bytes.tobytes()
        w = INDEX_DTYPE.itemsize
        for (seg, part), grp in groups.items():
            log_fd, idx_fd = self._part_fds(seg, part)
            write_all(log_fd, b"".join([blobs[i] for i in grp]))
            write_all(idx_fd, b"".join([raw[i * w:(i + 1) * w] for i in grp]))
            self._dirty.add((seg, part))

    # ---- checkpoints ----------------------------------------------------------------------------

    def checkpoint(self) -> None:
        """Make everything written so far durable in the parts and start a fresh ingest log file.

        Writers are held only while the ingest log rolls to a new file; the fsyncs run after, on
        duplicated descriptors, so appends and dispatch records go on meanwhile.
        """
        with self._write_lock:
            snapshot = self._rotate_locked()
        self._finish_checkpoint(snapshot)

    def _checkpoint_locked(self) -> None:
        self._finish_checkpoint(self._rotate_locked())

    def _rotate_locked(self) -> tuple[int, list[int], list[Path]]:
        """Under the write lock: take the dirty parts and roll the ingest log to a new file."""
        fds: list[int] = []
        paths: list[Path] = []
        for seg, part in self._dirty:
            open_fds = self._fds.get((seg, part))
            if open_fds is not None:
                fds.extend(os.dup(fd) for fd in open_fds)
            else:
                paths += [self.layout.part_log(seg, part), self.layout.part_index(seg, part)]
        self._dirty = set()
        with self._dispatch_lock:
            for seg in self._dispatch_dirty:
                fd = self._dispatch_fds.get(seg)
                if fd is not None:
                    fds.append(os.dup(fd))
            self._dispatch_dirty = set()
        new_seq = max([self._wal.seq, *self._wal.sequences()], default=-1) + 1
        self._wal.open_new(new_seq)
        return new_seq, fds, paths

    def _finish_checkpoint(self, snapshot: tuple[int, list[int], list[Path]]) -> None:
        """fsync what the rotation took, then move the checkpoint to the new ingest log file."""
        new_seq, fds, paths = snapshot
        with self._checkpoint_lock:
            for fd in fds:
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            for path in paths:
                fsync_path(path)
            self.meta.flush()
            fsync_path(self.layout.ingest_dir)
            current = self.meta.get_document("checkpoint")
            if current is None or current["seq"] < new_seq:
                self.meta.put_document("checkpoint", {"seq": new_seq, "pos": 0})
                self.meta.flush()
                self._wal.remove_before(new_seq)

    # ---- dispatch log ---------------------------------------------------------------------------

    def record_dispatch(self, segment_ms: int, entries: np.ndarray, now_ms: int) -> None:
        """Append entries (DISPATCH_DTYPE) to a segment's dispatch log as one frame."""
        if len(entries) == 0:
            return
        frame = _dispatch.encode_frame(entries, now_ms)
        with self._dispatch_lock:
            fd = self._dispatch_fds.get(segment_ms)
            if fd is None:
                path = self.layout.dispatch_log(segment_ms)
                path.parent.mkdir(parents=True, exist_ok=True)
                read = _dispatch.read_dispatch_log(path)
                if read.torn_bytes:  # a torn frame would hide every frame written after it
                    os.truncate(path, read.valid_bytes)
                fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                self._dispatch_fds[segment_ms] = fd
            end = os.lseek(fd, 0, os.SEEK_END)
            try:
                write_all(fd, frame)
                if self.flush == "sync":
                    os.fdatasync(fd)
            except OSError as e:
                os.ftruncate(fd, end)  # a torn frame would hide every frame written after it
                raise StorageWriteError(f"could not record {len(entries)} dispatch entries in "
                                        f"{self.layout.dispatch_log(segment_ms)}: {e}") from e
            if self.flush != "sync":
                self._dispatch_dirty.add(segment_ms)

    def dispatch_log(self, segment_ms: int) -> _dispatch.DispatchLogRead:
        """A segment's dispatch log as read now."""
        return _dispatch.read_dispatch_log(self.layout.dispatch_log(segment_ms))

    # ---- reads ----------------------------------------------------------------------------------

    def segment_index(self, segment_ms: int, parts: Sequence[int] | None = None) -> SegmentIndex:
        """The index of a segment (or of some of its parts), as far as it agrees with the logs
        (`trusted_index`)."""
        chunks, part_ids, bounds = [], [], []
        n = 0
        for part in (self.layout.list_parts(segment_ms) if parts is None else parts):
            idx_path = self.layout.part_index(segment_ms, part)
            if not idx_path.exists():
                continue  # a part being published, or one recovery has not indexed yet
            idx = trusted_index(self.layout.part_log(segment_ms, part), read_index(idx_path))
            chunks.append(idx)
            part_ids.append(np.full(len(idx), part, np.uint16))
            bounds.append((part, n, n + len(idx)))
            n += len(idx)
        if not chunks:
            e = np.empty(0, INDEX_DTYPE)
            return SegmentIndex(segment_ms, e["due_ms"], np.empty(0, np.uint16), e["offset"], e["length"], [])
        idx = chunks[0] if len(chunks) == 1 else np.concatenate(chunks)
        part = part_ids[0] if len(part_ids) == 1 else np.concatenate(part_ids)
        return SegmentIndex(segment_ms, idx["due_ms"], part, idx["offset"], idx["length"], bounds)

    def read_record(self, segment_ms: int, part: int, offset: int) -> Record:
        """Decode one record; raises CorruptRecordError (and counts it) when its bytes are bad."""
        out = self.read_records([segment_ms], [part], [offset])[0]
        if isinstance(out, CorruptRecordError):
            raise out
        return out

    def read_records(self, segment_ms: Sequence[int], parts: Sequence[int], offsets: Sequence[int],
                     due_ms: Sequence[int] | None = None) -> list[Record | CorruptRecordError]:
        """Decode many records; a corrupt one yields its error in its place (and is counted).

        With `due_ms` (what the index said), a record whose own CRC-checked due time differs is
        corrupt too: an index entry is never trusted to serve a record at another time.
        """
        out: list[Record | CorruptRecordError] = []
        dues: Sequence[int | None] = [None] * len(offsets) if due_ms is None else due_ms
        with self._read_lock:
            reader = None
            last_key = None
            for seg, part, off, due in zip(segment_ms, parts, offsets, dues, strict=True):
                key = (seg, part)
                try:
                    if key != last_key:
                        reader = self._readers.get(key)
                        if reader is None:
                            reader = self._readers[key] = PartReader(self.layout.part_log(seg, part))
                        last_key = key
                    assert reader is not None
                    view = reader.view(off + HEADER_SIZE)
                    length = record_length(view, off)
                    if off + length > len(view):
                        view = reader.view(off + length)
                    rec = decode(view, off)[0]
                    if due is not None and rec.due_ms != due:
                        raise CorruptRecordError(f"due {rec.due_ms}, index says {due}", offset=off)
                    out.append(rec)
                except (CorruptRecordError, OSError) as e:
                    self.corrupt_records_found += 1
                    reason = e.reason if isinstance(e, CorruptRecordError) else f"cannot read: {e}"
                    err = CorruptRecordError(reason, offset=off, path=str(self.layout.part_log(seg, part)))
                    err.__cause__ = e
                    out.append(err)
        return out

    def release_segment(self, segment_ms: int) -> None:
        """Drop read maps and the dispatch-log handle of a segment no longer in memory."""
        with self._read_lock:
            for key in [k for k in self._readers if k[0] == segment_ms]:
                self._readers.pop(key).close()

    # ---- retention ------------------------------------------------------------------------------

    def retire(self, now_ms: int, min_age_ms: int, *, archive: bool = False) -> list[int]:
        """Remove (or move to archive/) segments that ended at least `min_age_ms` ago and whose
        every record was dispatched, dead-lettered, cancelled or found corrupt; never others."""
        from storage.audit import summarize_segment

        retired = []
        for seg in self.layout.list_segments():
            if seg + self.layout.segment_ms + min_age_ms > now_ms:
                break
            if seg in self._live:
                continue
            if summarize_segment(self.layout, seg).pending:
                continue
            self.release_segment(seg)
            with self._dispatch_lock:
                fd = self._dispatch_fds.pop(seg, None)
                if fd is not None:
                    os.close(fd)
                self._dispatch_dirty.discard(seg)
            src = self.layout.segment_dir(seg)
            if archive:
                self.layout.archive_dir.mkdir(parents=True, exist_ok=True)
                os.replace(src, self.layout.archive_dir / src.name)
            else:
                shutil.rmtree(src)
            self.meta.forget_segment(seg)
            retired.append(seg)
        return retired

    # ---- lifecycle ------------------------------------------------------------------------------

    def seal_live_parts(self, before_ms: int) -> None:
        """Stop appending to live parts of segments that end at or before `before_ms`."""
        with self._write_lock:
            for seg in [s for s in self._live if s + self.layout.segment_ms <= before_ms]:
                del self._live[seg]

    def close(self) -> None:
        """Checkpoint and close every file."""
        if self._closed:
            return
        with self._write_lock:
            self._checkpoint_locked()
            self._closed = True
            for a, b in self._fds.values():
                os.close(a)
                os.close(b)
            self._fds.clear()
            self._wal.close()
        with self._dispatch_lock:
            for fd in self._dispatch_fds.values():
                os.close(fd)
            self._dispatch_fds.clear()
        with self._read_lock:
            for r in self._readers.values():
                r.close()
            self._readers.clear()
        self.meta.close()

    def __enter__(self) -> "ScheduleStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def repair_all_parts(store: ScheduleStore, segments: Sequence[int] | None = None) -> RecoveryReport:
    """Check every part's tail against its index (cost: one stat per part, a scan only of tails)."""
    rep = RecoveryReport()
    for seg in store.layout.list_segments() if segments is None else segments:
        for part in store.layout.list_parts(seg):
            rep.parts_checked += 1
            pr = repair_part(store.layout.part_log(seg, part), store.layout.part_index(seg, part))
            if pr.changed:
                rep.parts_repaired += 1
                rep.index_entries_added += pr.index_added
                rep.index_entries_dropped += pr.index_dropped
                rep.log_bytes_cut += pr.log_bytes_cut
                what = [f"{k}={v}" for k, v in (("rebuilt", pr.index_rebuilt), ("indexed", pr.index_added),
                                                  ("dropped", pr.index_dropped), ("cut_bytes", pr.log_bytes_cut))
                        if v]
                rep.findings.append(f"part {store.layout.part_log(seg, part)}: repaired ({', '.join(what)})"
                                    + (f": {pr.reason}" if pr.reason else ""))
    return rep
