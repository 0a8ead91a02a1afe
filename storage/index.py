"""The fixed-width index sidecar of a part: one 16-byte entry per record, in append order.

    due_ms  int64   UTC epoch ms the record is due
    offset  uint32  byte offset of the record in the part's .log
    length  uint32  record length in bytes

Loading a segment's index is one `numpy.fromfile` per part.
"""
from __future__ import annotations

import os
from typing import Sequence

import numpy as np

INDEX_DTYPE = np.dtype([("due_ms", "<i8"), ("offset", "<u4"), ("length", "<u4")])
INDEX_ENTRY_SIZE = INDEX_DTYPE.itemsize
MAX_PART_BYTES = 0xFFFFFFFF


def read_index(path: str | os.PathLike[str]) -> np.ndarray:
    """Entries of an index sidecar; a trailing partial entry (torn write) is ignored."""
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return np.empty(0, INDEX_DTYPE)
    return np.fromfile(path, dtype=INDEX_DTYPE, count=size // INDEX_ENTRY_SIZE)


def index_entries(due_ms: np.ndarray | Sequence[int], offsets: np.ndarray | Sequence[int],
                  lengths: np.ndarray | Sequence[int]) -> np.ndarray:
    """Index entries from columns: the one writer of the layout, for the engine, recovery and
    sealed parts alike."""
    out = np.empty(len(due_ms), INDEX_DTYPE)
    out["due_ms"] = due_ms
    out["offset"] = offsets
    out["length"] = lengths
    return out
