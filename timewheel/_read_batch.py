"""Due entries read from the store into a send batch: the good records, and the rows found corrupt.

Two forms, as the sink takes them: stored bytes (`read_bytes`, for a `RecordSink`) or a `Message`
per record (`read_messages`). The index's due times go along: a record whose own (CRC-checked)
due time differs is reported with it, to be sent at its own due time rather than counted corrupt.
"""
from __future__ import annotations

import logging

import numpy as np

from storage import CorruptRecordError, ScheduleStore
from timewheel._held import Batch
from timewheel.message import Message

__all__ = ["read_bytes", "read_messages"]

log = logging.getLogger("timewheel.dispatcher")

#: per corrupt row: its row in what was read, and the record's own due time when only that disagrees
CorruptRows = list[tuple[int, int | None]]


def read_bytes(store: ScheduleStore, due: np.ndarray, refs: np.ndarray, attempts: np.ndarray, segs: np.ndarray,
               parts: np.ndarray, offsets: np.ndarray) -> tuple[Batch, CorruptRows]:
    """The good records as stored bytes (for `send_records`), and the rows found corrupt."""
    raw = store.read_record_bytes(segs, parts, offsets, due)
    for err in raw.errors.values():
        if err.record_due_ms is None:
            log.error("corrupt record skipped, never served: %s", err)
    if not raw.errors:
        return Batch(None, due, refs, attempts, segs, parts, offsets, raw), []
    k = np.flatnonzero(raw.ok)
    return (Batch(None, due[k], refs[k], attempts[k], segs[k], parts[k], offsets[k], raw.select(k)),
            [(r, raw.errors[r].record_due_ms) for r in np.flatnonzero(~raw.ok).tolist()])


def read_messages(store: ScheduleStore, due: np.ndarray, refs: np.ndarray, attempts: np.ndarray, segs: np.ndarray,
                  parts: np.ndarray, offsets: np.ndarray) -> tuple[Batch, CorruptRows]:
    """The good records as `Message` objects (for `send_batch`), and the rows found corrupt."""
    messages: list[Message] = []
    ok_idx: list[int] = []
    corrupt: CorruptRows = []
    from_record = Message.from_record
    records = store.read_records(segs.tolist(), parts.tolist(), offsets.tolist(), due.tolist())
    for i, (rec, att) in enumerate(zip(records, attempts.tolist())):
        if isinstance(rec, CorruptRecordError):
            if rec.record_due_ms is None:
                log.error("corrupt record skipped, never served: %s", rec)
            corrupt.append((i, rec.record_due_ms))
            continue
        messages.append(from_record(rec, att + 1))
        ok_idx.append(i)
    k = np.asarray(ok_idx, np.int64)
    return Batch(messages, due[k], refs[k], attempts[k], segs[k], parts[k], offsets[k]), corrupt
