"""The per-segment dispatch log: what happened to each record, in fixed-width 24-byte rows.

The file is a sequence of frames; a frame is one header row followed by `count` entry rows.

    header row: magic uint32 (0x32445754, "TWD2"), count uint32, crc uint32, reserved uint32,
                written_ms int64
    entry row:  due_ms int64, dispatch_ms int64, offset uint32, part uint16, outcome uint8,
                attempts uint8

A frame's CRC32C covers every other byte of it: the header's magic and count, its reserved and
written_ms fields, then the entry rows. Frames of the first version (magic 0x50445754, "TWDP",
CRC of the entry rows only) are still read. A frame that fails its checks is skipped and counted,
and reading resyncs on the next row that starts a valid frame (rows are fixed width), so one bad
frame never hides the frames after it; bytes after the last valid frame are a torn tail.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from storage.record import crc32c

DISPATCH_DTYPE = np.dtype([("due_ms", "<i8"), ("dispatch_ms", "<i8"), ("offset", "<u4"), ("part", "<u2"),
                           ("outcome", "u1"), ("attempts", "u1")])
_HEADER_DTYPE = np.dtype([("magic", "<u4"), ("count", "<u4"), ("crc", "<u4"), ("reserved", "<u4"),
                          ("written_ms", "<i8")])
ROW_SIZE = DISPATCH_DTYPE.itemsize
assert _HEADER_DTYPE.itemsize == ROW_SIZE
FRAME_MAGIC = 0x32445754  # "TWD2": the CRC covers the header too
FRAME_MAGIC_V1 = 0x50445754  # "TWDP": the CRC covers the entry rows only; read, never written
_MAGICS = (FRAME_MAGIC, FRAME_MAGIC_V1)
_CRC_AT = _HEADER_DTYPE["magic"].itemsize + _HEADER_DTYPE["count"].itemsize  # the crc field follows them
_CRC_END = _CRC_AT + _HEADER_DTYPE["crc"].itemsize

DELIVERED = 1
DEAD_LETTERED = 2
CANCELLED = 3
REPLAYED = 4
CORRUPT = 5
OUTCOME_NAMES = {DELIVERED: "delivered", DEAD_LETTERED: "dead_lettered", CANCELLED: "cancelled",
                 REPLAYED: "replayed", CORRUPT: "corrupt"}
TERMINAL = (DELIVERED, DEAD_LETTERED, CANCELLED, CORRUPT)  # a record with one of these is done


def dispatch_entries(part: np.ndarray | int, offset: np.ndarray, due_ms: np.ndarray, dispatch_ms: np.ndarray | int,
                     outcome: int, attempts: np.ndarray | int = 1) -> np.ndarray:
    """Build dispatch entries from columns (scalars broadcast)."""
    out = np.empty(len(offset), DISPATCH_DTYPE)
    out["part"] = part
    out["offset"] = offset
    out["due_ms"] = due_ms
    out["dispatch_ms"] = dispatch_ms
    out["outcome"] = outcome
    out["attempts"] = np.minimum(attempts, 255)
    return out


def encode_frame(entries: np.ndarray, written_ms: int) -> bytes:
    """One frame: a header row and the entry rows."""
    body = np.ascontiguousarray(entries, dtype=DISPATCH_DTYPE).tobytes()
    header = np.zeros(1, _HEADER_DTYPE)
    header["magic"] = FRAME_MAGIC
    header["count"] = len(entries)
    header["written_ms"] = written_ms
    header["crc"] = frame_crc(header.tobytes(), body)
    return header.tobytes() + body


def frame_crc(header: bytes, body: bytes) -> int:
    """CRC32C of a frame: its header row without the crc field, then its entry rows."""
    return crc32c(body, crc32c(header[_CRC_END:ROW_SIZE], crc32c(header[:_CRC_AT])))


@dataclass(frozen=True, slots=True)
class DispatchLogRead:
    """A dispatch log as read: the valid entries, and what was found wrong."""

    entries: np.ndarray
    valid_bytes: int
    corrupt_frames: int
    torn_bytes: int


def read_dispatch_log(path: str | os.PathLike[str]) -> DispatchLogRead:
    """Read every valid frame; skips (and counts) bad frames, resyncing on the next valid one."""
    try:
        raw = np.fromfile(path, dtype=np.uint8)
    except FileNotFoundError:
        return DispatchLogRead(np.empty(0, DISPATCH_DTYPE), 0, 0, 0)
    n_rows = len(raw) // ROW_SIZE
    rows = raw[: n_rows * ROW_SIZE]
    headers = rows.view(_HEADER_DTYPE)
    starts: np.ndarray | None = None  # rows that may start a frame, found at the first bad one
    chunks: list[np.ndarray] = []
    row = end = corrupt = 0
    while row < n_rows:
        count = _frame_at(rows, headers, row)
        if count is not None:
            chunks.append(rows[(row + 1) * ROW_SIZE:(row + 1 + count) * ROW_SIZE].view(DISPATCH_DTYPE))
            row = end = row + 1 + count
            continue
        # a bad frame: its count cannot be trusted, so look for the next row that starts a valid one
        if starts is None:
            starts = np.flatnonzero(np.isin(headers["magic"], _MAGICS))
        later = starts[np.searchsorted(starts, row, side="right"):].tolist()
        row = next((r for r in later if _frame_at(rows, headers, r) is not None), n_rows)
        corrupt += row < n_rows  # with no valid frame after it, it is the torn tail
    entries = np.concatenate(chunks) if chunks else np.empty(0, DISPATCH_DTYPE)
    return DispatchLogRead(entries, end * ROW_SIZE, corrupt, len(raw) - end * ROW_SIZE)


def _frame_at(rows: np.ndarray, headers: np.ndarray, row: int) -> int | None:
    """The entry count of the valid frame starting at `row`, or None."""
    magic, count = int(headers["magic"][row]), int(headers["count"][row])
    if magic not in _MAGICS or row + 1 + count > len(headers):
        return None
    body = rows[(row + 1) * ROW_SIZE:(row + 1 + count) * ROW_SIZE].tobytes()
    found = frame_crc(rows[row * ROW_SIZE:(row + 1) * ROW_SIZE].tobytes(), body) if magic == FRAME_MAGIC \
        else crc32c(body)
    return count if found == int(headers["crc"][row]) else None
