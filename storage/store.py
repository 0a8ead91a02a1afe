"""The schedule store: appends with group commit, recovery on open, checkpoints; a facade over the
write path (`storage._writer`), reads (`storage._reader`), dispatch logs (`storage._dispatch_writer`)
and retention (`storage.retention`).

Write path of one group commit (many callers' batches merged into one):
  1. dedup: ids already stored (meta store) or repeated in the batch are not written again;
  2. the whole batch goes to the ingest log as one frame (one write; one fsync with flush="sync");
  3. each touched segment's live part gets one write of records and one of index entries;
  4. ids and business keys go to the meta store in one write batch.
A crash anywhere in 2-4 is repaired on open by replaying the ingest log from the last checkpoint.
A checkpoint fsyncs the parts and dispatch logs written since the previous one and the directories
that gained a name, then lets older log files go, so a restart replays at most `checkpoint_bytes`
of frames, whatever the backlog.
"""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Sequence

import numpy as np

from storage import dispatch as _dispatch
from storage._checkpoints import Checkpoints, Rotation
from storage._dispatch_writer import DispatchWriter
from storage._files import close_all, fsync_path
from storage._listeners import CommitListeners
from storage._reader import RecordReader, SegmentIndex, segment_index
from storage.record_bytes import RecordBytes
from storage._writer import PartWriter, UndoPoint
from storage.encoded import EncodedRecords
from storage.errors import (CorruptRecordError, DelayTooLongError, MetaStoreCorruptError, MetaStoreStoppedError,
                            StorageWriteError, StoreClosedError)
from storage.index import MAX_PART_BYTES
from storage.ingest_log import LOCATION_DTYPE, IngestLog
from storage.layout import SegmentLayout, moving_out
from storage.meta import MetaStore
from storage.origin import OriginReader, QueueTable, origin_rows, unknown_origins
from storage.record import Record, encode
from storage.recovery import RecoveryReport, recover

log = logging.getLogger("timewheel.storage")
FlushPolicy = Literal["async", "sync"]
TWO_YEARS_MS = 17_568 * 3_600_000

__all__ = ["AppendResult", "FlushPolicy", "Origin", "RecoveryReport", "ScheduleStore", "SegmentIndex", "TWO_YEARS_MS"]


@dataclass(frozen=True, slots=True)
class AppendResult:
    """Outcome of an append: per input record, its location and whether it was newly stored."""

    msg_ids: list[str]
    locations: np.ndarray  # LOCATION_DTYPE; for duplicates, where the first copy lives (due_ms/length 0)
    new: np.ndarray  # bool

    def __len__(self) -> int:
        return len(self.msg_ids)


#: where a record came from: (queue name `broker:queue id`, offset in that queue), or None
Origin = tuple[str, int] | None


@dataclass(slots=True)
class _Pending:
    """One caller's rows in a group commit: records to encode, or records already encoded."""

    rows: Sequence[Record] | EncodedRecords
    origins: Sequence[Origin] | None = None
    done: bool = False
    result: AppendResult | None = None
    error: BaseException | None = None


class ScheduleStore:
    """Hourly (configurable) schedule-log segments with an ingest log, dispatch logs and a meta store."""

    def __init__(self, data_dir: str | os.PathLike[str], *, segment_minutes: int = 60,
                 flush: FlushPolicy = "async", max_delay_ms: int = TWO_YEARS_MS,
                 max_part_bytes: int = 1 << 30, checkpoint_bytes: int = 64 << 20,
                 meta_cache_bytes: int | None = None) -> None:
        if flush not in ("async", "sync"):
            raise ValueError(f"flush must be 'async' or 'sync', not {flush!r}")
        if not 0 < max_part_bytes <= MAX_PART_BYTES:
            raise ValueError(f"max_part_bytes must be in (0, {MAX_PART_BYTES}]")
        self.layout = SegmentLayout(data_dir, segment_minutes)
        self.flush = flush
        self.max_delay_ms = max_delay_ms
        self.max_part_bytes = max_part_bytes
        self.checkpoint_bytes = checkpoint_bytes
        self.origins = OriginReader(self.layout)  # of the origin sidecars; `queues` numbers their queues
        self._wal = IngestLog(self.layout.ingest_dir, sync_dir=flush == "sync")
        self.writer = PartWriter(self.layout, max_part_bytes)
        self.reader = RecordReader(self.layout)
        self.dispatch_writer = DispatchWriter(self.layout, sync=flush == "sync")
        self._write_lock = threading.Lock()
        self._cv = threading.Condition()
        self._queue: list[_Pending] = []
        self._committing = False
        self._closed = False
        self._listeners = CommitListeners()
        #: told of each commit's new records under the write lock (`storage._listeners`)
        self.commit_listeners = self._listeners.listeners
        self._due_checkpoint: Rotation | None = None
        #: old segments retention found pending, with their files' sizes then (`storage.retention`)
        self.pending_old: dict[int, tuple[tuple[str, int], ...]] = {}
        # last, and closed by whatever fails after: left open, its lock refuses the next open of the directory
        self.meta = MetaStore(self.layout.meta_dir, block_cache_bytes=meta_cache_bytes)
        try:
            #: the delay topic's queues that origin sidecars number (a meta store document)
            self.queues = QueueTable(self.meta)
            self._checkpoints = Checkpoints(self.layout, self.meta, self._wal, self.writer, self.dispatch_writer)
            self.recovery: RecoveryReport = recover(self)
            self._checkpoint_locked()
        except BaseException:  # the caller gets no store to close: what it opened is closed here
            self._closed = True
            self._close_files(raising=False)  # the open's own error is the one the caller needs
            raise

    # ---- append with group commit -------------------------------------------------------------

    def append(self, records: Sequence[Record], now_ms: int, origins: Sequence[Origin] | None = None) -> AppendResult:
        """Store records durably under the flush policy; repeated ids are stored once.

        `origins`, aligned with `records`: where each came from on the delay topic (kept in the
        parts' origin sidecars, `storage.origin`); None: unknown.

        Raises DelayTooLongError (nothing written) if any record is due past the maximum delay.
        Concurrent callers are merged into one commit.
        """
        for r in records:
            if r.due_ms - now_ms > self.max_delay_ms:
                raise DelayTooLongError(r.due_ms, now_ms, self.max_delay_ms)
        if origins is not None and len(origins) != len(records):
            raise ValueError(f"{len(origins)} origins for {len(records)} records")
        return self._group_commit(_Pending(records, origins), now_ms)

    def append_encoded(self, rows: EncodedRecords, now_ms: int) -> AppendResult:
        """`append` for records already encoded (`storage.EncodedRecords`: their bytes as `encode`
        writes them, with their ids, due times, keys and origins): the same checks, dedup, commit
        and results, without a `Record` per row.

        Raises DelayTooLongError (nothing written) if any row is due past the maximum delay.
        """
        if rows.due_ms:
            dues = np.asarray(rows.due_ms, np.int64)
            late = np.flatnonzero(dues - now_ms > self.max_delay_ms)
            if late.size:
                raise DelayTooLongError(int(dues[late[0]]), now_ms, self.max_delay_ms)
        return self._group_commit(_Pending(rows), now_ms)

    def _group_commit(self, req: _Pending, now_ms: int) -> AppendResult:
        """Queue one caller's rows and commit them, merged with whatever other callers queued meanwhile."""
        if self._closed:
            raise StoreClosedError("the store is closed")
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
                rotation, self._due_checkpoint = self._due_checkpoint, None
            if rotation is not None:  # the fsyncs run outside the write lock
                self._checkpoints.finish(rotation)
        except BaseException as e:  # every waiter learns of the failure
            for req in batch:
                if not req.done:
                    req.error = e
                    req.done = True
            raise

    def _commit_locked(self, batch: list[_Pending], now_ms: int) -> None:
        rows = _columns(batch)
        ids, items = rows.msg_ids, rows.blobs
        existing = self.meta.locations(ids)
        n = len(ids)
        locs = np.zeros(n, LOCATION_DTYPE)
        new = np.zeros(n, bool)
        first_seen: dict[str, int] = {}
        blobs: list[bytes] = []
        new_pos: list[int] = []
        dups: list[tuple[int, int]] = []
        every = existing.count(None) == n and len(set(ids)) == n and all(type(b) is bytes for b in items)
        if every:  # the usual batch of encoded records, all new and each once: nothing to sort out
            blobs, new_pos = list(items), list(range(n))
        else:
            for i, mid in enumerate(ids):
                loc = existing[i]
                if loc is not None:
                    locs[i] = (loc.segment_ms, 0, loc.offset, 0, loc.part, 0, 0)
                    continue
                j = first_seen.get(mid)
                if j is not None:
                    dups.append((i, j))
                    continue
                first_seen[mid] = i
                item = items[i]
                blobs.append(item if isinstance(item, bytes) else encode(item, item.enqueue_ms or now_ms))
                new_pos.append(i)
        if blobs:
            def new_of(column: list[Any]) -> list[Any]:
                return column if every else [column[i] for i in new_pos]

            dues = new_of(rows.due_ms)
            undo = self._undo_point()
            written = self.writer.place(dues, blobs)
            pos = np.asarray(new_pos)
            new[pos] = True
            locs[pos] = written
            for i, j in dups:
                locs[i] = locs[j]
            try:
                self._wal.append(written, blobs, now_ms, sync=self.flush == "sync")
                self.writer.write(written, blobs, self._origin_rows(new_of(rows.queues), new_of(rows.offsets)))
                # the meta store last, and inside: a batch it refuses (a full disk stops RocksDB's
                # writes) is cut too, or its retry would store and send every record a second time
                self.meta.put_records(new_of(ids), written["segment_ms"].tolist(), written["part"].tolist(),
                                      written["offset"].tolist(), new_of(rows.keys))
            except Exception as e:  # OSError from the files; the meta store's own error type
                self._roll_back(undo)
                if isinstance(e, (MetaStoreCorruptError, MetaStoreStoppedError)):  # no free space mends these alone:
                    raise  # their words say what does
                raise StorageWriteError(f"could not store {len(blobs)} records in {self.layout.root}: {e}; "
                                        "nothing of this batch was kept (free disk space, then retry)") from e
            self._listeners.tell(written)
        start = 0
        for req in batch:
            end = start + len(req.rows)
            req.result = AppendResult(ids[start:end], locs[start:end], new[start:end])
            req.done = True
            start = end
        if self._wal.position >= self.checkpoint_bytes:
            self._due_checkpoint = self._checkpoints.rotate()

    @property
    def commit_listener_failure(self) -> str | None:
        """Why a commit listener failed since the store was opened (what it missed is stored, not handed on)."""
        return self._listeners.failure

    def _origin_rows(self, queues: list[str | None], offsets: list[int]) -> np.ndarray:
        if not any(queues):
            return unknown_origins(len(queues))
        return origin_rows(self.queues.numbers(queues), offsets)

    def read_origins(self, segment_ms: np.ndarray, parts: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """Where records came from (ORIGIN_DTYPE rows, queue numbers of `self.queues`; NO_QUEUE: unknown)."""
        return self.origins.read(segment_ms, parts, offsets)

    def _undo_point(self) -> tuple[int, int, UndoPoint]:
        """Where the ingest log and every live part end now, to return to if a commit fails."""
        return self._wal.seq, self._wal.position, self.writer.undo_point()

    def _roll_back(self, undo: tuple[int, int, UndoPoint]) -> None:
        """Cut what a failed commit wrote (a torn frame or record would hide later ones)."""
        seq, pos, live = undo
        try:
            self._wal.truncate(seq, pos)
        except OSError:
            log.exception("could not cut the ingest log back after a failed write")
        self.writer.roll_back(live)

    # ---- checkpoints ----------------------------------------------------------------------------

    def checkpoint(self) -> None:
        """Make everything written so far durable in the parts and start a fresh ingest log file.

        Writers are held only while the ingest log rolls to a new file; the fsyncs run after, on
        duplicated descriptors, so appends and dispatch records go on meanwhile.
        """
        with self._write_lock:
            rotation = self._checkpoints.rotate()
        self._checkpoints.finish(rotation)

    def _checkpoint_locked(self) -> None:
        self._checkpoints.finish(self._checkpoints.rotate())

    @property
    def checkpoints_stopped(self) -> str | None:
        """The failed fsync that stopped checkpoints for the rest of this process (`storage._checkpoints`),
        if one did: a restart replays the ingest log since the last checkpoint."""
        return self._checkpoints.broken

    # ---- dispatch log ---------------------------------------------------------------------------

    def record_dispatch(self, segment_ms: int, entries: np.ndarray, now_ms: int, answers: np.ndarray | None = None,
                        note: str = "") -> None:
        """Append entries (DISPATCH_DTYPE) to a segment's dispatch log as one frame, with the broker's
        answers (ANSWER_DTYPE, aligned with them) and a note (why: an error, a reason) when given."""
        self.dispatch_writer.append(segment_ms, entries, now_ms, answers, note)

    def dispatch_log(self, segment_ms: int) -> _dispatch.DispatchLogRead:
        """A segment's dispatch log as read now."""
        return _dispatch.read_dispatch_log(self.layout.dispatch_log(segment_ms))

    # ---- reads ----------------------------------------------------------------------------------

    def segment_index(self, segment_ms: int, parts: Sequence[int] | None = None) -> SegmentIndex:
        """The index of a segment (or of some of its parts), as far as it agrees with the logs."""
        return segment_index(self.layout, segment_ms, parts)

    def read_record(self, segment_ms: int, part: int, offset: int) -> Record:
        """Decode one record; raises CorruptRecordError (and counts it) when its bytes are bad."""
        out = self.reader.read([segment_ms], [part], [offset])[0]
        if isinstance(out, CorruptRecordError):
            raise out
        return out

    def read_records(self, segment_ms: Sequence[int], parts: Sequence[int], offsets: Sequence[int],
                     due_ms: Sequence[int] | None = None) -> list[Record | CorruptRecordError]:
        """Decode many records; a corrupt one yields its error in its place (and is counted).

        With `due_ms` (what the index said), a record whose own CRC-checked due time differs is
        corrupt too: an index entry is never trusted to serve a record at another time.
        """
        return self.reader.read(segment_ms, parts, offsets, due_ms)

    def read_record_bytes(self, segment_ms: np.ndarray, parts: np.ndarray, offsets: np.ndarray,
                          due_ms: np.ndarray | None = None) -> RecordBytes:
        """Many records as CRC-checked bytes with their header columns, without an object each
        (`RecordBytes`); the checks and the counting of corrupt records are those of `read_records`."""
        return self.reader.read_bytes(segment_ms, parts, offsets, due_ms)

    @property
    def corrupt_records_found(self) -> int:
        """Records found corrupt by reads since the store was opened."""
        return self.reader.corrupt_found

    def release_segment(self, segment_ms: int) -> None:
        """Drop the read maps of a segment no longer in memory."""
        self.reader.release(segment_ms)
        self.origins.forget(segment_ms)

    def take_out_segment(self, segment_ms: int, unchanged: Callable[[], bool], dst: Path) -> bool:
        """Move a segment's directory to `dst`, its descriptors closed (one held open would keep a
        deleted file's space), if no part of it is live and `unchanged()` holds, with no append in
        between: retention decided it was done, and a record stored since must not go with it."""
        self.release_segment(segment_ms)
        seg_dir = self.layout.segment_dir(segment_ms)
        # the segment directory's lock too: a backfill's publish takes a part number under it alone
        with self._write_lock, moving_out(seg_dir):
            if segment_ms in self.writer.live or not self.checkpointed(segment_ms) or not unchanged():
                return False
            self.writer.forget(segment_ms)
            self.dispatch_writer.forget(segment_ms)
            # its done mark first, synced: left behind, it would take a part published later into the hour for sent
            self.meta.forget_segment(segment_ms, sync=True)
            os.replace(seg_dir, dst)
        fsync_path(self.layout.schedule_dir)  # out of schedule/ for good before its files go
        return True

    def put_back_records(self, segment_ms: int, msg_ids: Sequence[str], parts: Sequence[int], offsets: Sequence[int],
                         keys: Sequence[Sequence[str]], cancelled: Sequence[int | None]) -> int:
        """Give the meta store back the entries retention forgot of a segment it then could not move
        (`storage.retention`); an id stored again since keeps its new entries. Returns how many."""
        with self._write_lock:  # no commit between the look-up and the write: a new copy is never overwritten
            gone = [k for k, loc in enumerate(self.meta.locations(msg_ids)) if loc is None]
            self.meta.restore_records([msg_ids[k] for k in gone], segment_ms, [parts[k] for k in gone],
                                      [offsets[k] for k in gone], [keys[k] for k in gone], [cancelled[k] for k in gone])
        return len(gone)

    # ---- retention and lifecycle ----------------------------------------------------------------

    def checkpointed(self, segment_ms: int) -> bool:
        """Whether every record stored in the segment is past the last checkpoint: a crash replays
        none of them from the ingest log (retired before that, a record would come back, pending)."""
        return self.writer.log_seq_of.get(segment_ms, -1) < self._checkpoints.durable_seq

    def retire(self, now_ms: int, min_age_ms: int, *, archive: bool = False) -> list[int]:
        """Remove (or archive) old segments whose every record is done (`storage.retention.retire`)."""
        from storage.retention import retire  # retention reads segments through the audit

        return retire(self, now_ms, min_age_ms, archive=archive)

    def is_live(self, segment_ms: int) -> bool:
        """Whether the store is appending to a part of this segment."""
        return segment_ms in self.writer.live

    def mark_segment_done(self, segment_ms: int, nothing_waits: Callable[[], bool], parts: Sequence[int] = ()) -> bool:
        """Mark a segment done, read from `parts`, if `nothing_waits()` (no record stored in it waits for
        its listener's owner) and no listener failed, with no commit in between: one after it clears the mark."""
        with self._write_lock:
            if self._listeners.failure is not None or not nothing_waits():
                return False
            self.meta.mark_segment_done(segment_ms, parts)
            return True

    def seal_live_parts(self, before_ms: int) -> None:
        """Stop appending to live parts of segments that end at or before `before_ms`."""
        with self._write_lock:
            self.writer.seal(before_ms)

    def close(self) -> None:
        """Checkpoint and close every file; a failed checkpoint is raised after every file is closed
        (what it did not make durable is in the ingest log, replayed at the next open)."""
        if self._closed:
            return
        with self._write_lock:
            try:
                self._checkpoint_locked()
            finally:
                self._closed = True
                self._close_files()

    def _close_files(self, raising: bool = True) -> None:
        """Close the writers' descriptors, the read maps and the meta store (rocksdb's files and lock), each
        whatever the others raise; the first error is raised after (`raising`) or logged."""
        close_all((self.writer.close, self._wal.close, self.dispatch_writer.close, self.reader.close, self.meta.close),
                  raising=raising)

    def __enter__(self) -> "ScheduleStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _columns(batch: list[_Pending]) -> EncodedRecords:
    """The rows of a group commit as columns; a `Record` stands where its bytes will (encoded only
    if it is stored: a duplicate never is)."""
    if len(batch) == 1 and isinstance(batch[0].rows, EncodedRecords):
        return batch[0].rows
    out = EncodedRecords()
    for req in batch:
        if isinstance(req.rows, EncodedRecords):
            out.extend(req.rows)
        else:
            out.extend_unencoded(req.rows, req.origins)
    return out
