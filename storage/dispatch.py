"""The per-segment dispatch log: what happened to each record, in fixed-width 24-byte rows.

The file is a sequence of frames; a frame is one header row followed by `count` entry rows.

    header row: magic uint32 (0x50445754, "TWDP"), count uint32, crc uint32 (CRC32C of the
                entry rows), reserved uint32, written_ms int64
    entry row:  due_ms int64, dispatch_ms int64, offset uint32, part uint16, outcome uint8,
                attempts uint8

A frame's CRC covers its entries, so a torn or corrupt frame is found and its rows never served.
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
FRAME_MAGIC = 0x50445754

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
    header["crc"] = crc32c(body)
    header["written_ms"] = written_ms
    return header.tobytes() + body


@dataclass(frozen=True, slots=True)
class DispatchLogRead:
    """A dispatch log as read: the valid entries, and what was found wrong."""

    entries: np.ndarray
    valid_bytes: int
    corrupt_frames: int
    torn_bytes: int


def read_dispatch_log(path: str | os.PathLike[str]) -> DispatchLogRead:
    """Read every valid frame; stops at a torn tail, skips frames whose CRC fails."""
    try:
        raw = np.fromfile(path, dtype=np.uint8)
    except FileNotFoundError:
        return DispatchLogRead(np.empty(0, DISPATCH_DTYPE), 0, 0, 0)
    n_rows = len(raw) // ROW_SIZE
    rows = raw[: n_rows * ROW_SIZE]
    headers = rows.view(_HEADER_DTYPE)
    chunks: list[np.ndarray] = []
    row = corrupt = 0
    while row < n_rows:
        h = headers[row]
        count = int(h["count"])
        if int(h["magic"]) != FRAME_MAGIC or row + 1 + count > n_rows:
            break  # torn tail, or a header we cannot trust: nothing after it can be framed
        body = rows[(row + 1) * ROW_SIZE:(row + 1 + count) * ROW_SIZE]
        if crc32c(body.tobytes()) == int(h["crc"]):
            chunks.append(body.view(DISPATCH_DTYPE))
        else:
            corrupt += 1
        row += 1 + count
    entries = np.concatenate(chunks) if chunks else np.empty(0, DISPATCH_DTYPE)
    return DispatchLogRead(entries, row * ROW_SIZE, corrupt, len(raw) - row * ROW_SIZE)
