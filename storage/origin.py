"""Where each record came from: its (queue, offset) on the delay topic, in a sidecar beside the index.

`NNNNN.org` holds one 16-byte row per index entry of part `NNNNN`, in the same order:

    queue    int32   the queue's number in this data directory's queue table (-1: unknown)
    check    uint32  CRC32C of the row's 12 other bytes (queue then offset, as stored)
    offset   int64   the message's offset in that queue

Queues are named `<broker>:<queue id>`; the table of names lives in the meta store (document
`origin_queues`, a list whose positions are the numbers), so a row stays 16 bytes whatever the
broker names. A record written without an origin (the Python API, Spark backfill, a part of a
data directory written before origins existed, which has no sidecar) has queue -1: "origin unknown".

A row the sidecar does not have (it is written before the index, but an OS crash may cut it short;
recovery writes such rows back as lost) reads as lost (LOST_QUEUE: it had an origin, nobody knows
which); so does a row that fails its check, which is counted: a filesystem that writes a file's
size back before its data (ext4 `data=writeback`) leaves rows that never reached the disk as zeros,
which would otherwise read as queue 0, offset 0. Rows written before rows carried a check have 0
there; such a row is read as it was written, unchecked, unless it is all zeros (lost data looks the
same) or names no possible origin (a queue below -1 or a negative offset).

Replica sets (docs/HA.md) need it: a standby counts a record as sent by the lease holder only when
its due time is at or before the holder's watermark and its offset is below the offset up to
which the holder had stored its queue.
"""
from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from operator import itemgetter
from pathlib import Path
from typing import Sequence

import crc32c as _crc32c
import numpy as np

from storage._files import write_all
from storage.index import read_index

__all__ = ["LOST_QUEUE", "NO_QUEUE", "ORIGIN_DTYPE", "ORIGIN_ROW_SIZE", "OriginReader", "QueueTable", "read_origins"]

ORIGIN_DTYPE = np.dtype([("queue", "<i4"), ("check", "<u4"), ("offset", "<i8")])
ORIGIN_ROW_SIZE = ORIGIN_DTYPE.itemsize
#: the queue number of a record whose origin is unknown
NO_QUEUE = -1
#: the queue number of a record whose origin row was written but cannot be read (it fails its check,
#: or lies past the end of a sidecar cut short): unlike NO_QUEUE's records, it came from the delay
#: topic, from an offset nobody knows, so a replica set must not judge it by the watermark alone
LOST_QUEUE = -2
#: the sidecar's suffix beside `NNNNN.idx`
ORIGIN_SUFFIX = ".org"
_DOCUMENT = "origin_queues"
_CACHED_PARTS = 64
log = logging.getLogger("timewheel.storage")

#: the bytes of a row its check covers: queue, then offset
_CHECKED = (0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15)
_ZEROS_CRC = _crc32c.crc32c(bytes(len(_CHECKED)))


def _word_tables() -> np.ndarray:
    """What each value of each checked 16-bit word of a row adds to the CRC32C of its 12 bytes.

    A CRC is affine over its input: for messages of one length, crc(a ^ b) = crc(a) ^ crc(b) ^
    crc(zeros). So the CRC of a row is crc(zeros) xored with one entry per 16-bit word (6 look-ups
    a row, 1.5 MiB of tables), which numpy takes for every row of a sidecar at once (a call of the
    C library per row is 20 times slower); and an entry is the xor of what each of its bits adds."""
    tables = np.zeros((len(_CHECKED) // 2, 1 << 16), np.uint32)
    for w, table in enumerate(tables):
        for bit in range(16):
            one = bytearray(len(_CHECKED))
            one[2 * w + bit // 8] = 1 << (bit % 8)  # "<u2": the word's low byte first
            table[1 << bit:2 << bit] = table[:1 << bit] ^ (_crc32c.crc32c(bytes(one)) ^ _ZEROS_CRC)
    return tables


_TABLES = _word_tables()
#: the checked words of a row as "<u2": queue's two, then offset's four
_WORDS = (0, 1, 4, 5, 6, 7)


def row_checks(rows: np.ndarray) -> np.ndarray:
    """The CRC32C of each ORIGIN_DTYPE row's queue and offset bytes (what its `check` must hold)."""
    words = np.ascontiguousarray(rows, ORIGIN_DTYPE).view("<u2").reshape(-1, ORIGIN_ROW_SIZE // 2)
    out = np.full(len(words), _ZEROS_CRC, np.uint32)
    for table, at in zip(_TABLES, _WORDS):
        out ^= table[words[:, at]]
    return out


def good_rows(rows: np.ndarray) -> np.ndarray:
    """Which rows may be read (a bool each): their check holds, or they are rows written before rows
    carried a check (0 there) that are not all zeros and name a possible origin."""
    check = rows["check"]
    unchecked = ((check == 0) & ((rows["queue"] != 0) | (rows["offset"] != 0))
                 & (rows["queue"] >= NO_QUEUE) & (rows["offset"] >= 0))
    return (check == row_checks(rows)) | unchecked


def origin_rows(queues: np.ndarray | Sequence[int], offsets: np.ndarray | Sequence[int]) -> np.ndarray:
    """Sidecar rows from columns (the one writer of the layout)."""
    out = np.zeros(len(queues), ORIGIN_DTYPE)
    out["queue"] = queues
    out["offset"] = offsets
    out["check"] = row_checks(out)
    return out


def unknown_origins(n: int) -> np.ndarray:
    """`n` rows saying "origin unknown"."""
    return origin_rows(np.full(n, NO_QUEUE, np.int32), np.zeros(n, np.int64))


def lost_origins(n: int) -> np.ndarray:
    """`n` rows saying "written, and lost" (LOST_QUEUE; never written to a sidecar)."""
    return origin_rows(np.full(n, LOST_QUEUE, np.int32), np.zeros(n, np.int64))


def align_rows(fd: int, rows: int) -> int:
    """Make the sidecar open at `fd` exactly `rows` rows long: rows past them and a torn row are cut,
    rows it lacks are written as lost (LOST_QUEUE), so that the next row written is row `rows`;
    returns how many rows were written as lost."""
    size = os.fstat(fd).st_size
    if size == rows * ORIGIN_ROW_SIZE:
        return 0
    have = min(size // ORIGIN_ROW_SIZE, rows)
    os.ftruncate(fd, have * ORIGIN_ROW_SIZE)
    os.lseek(fd, have * ORIGIN_ROW_SIZE, os.SEEK_SET)  # where a descriptor opened O_APPEND writes anyway
    write_all(fd, lost_origins(rows - have).tobytes())
    return rows - have


def shortfall(path: str | os.PathLike[str], count: int) -> str | None:
    """What a sidecar lacks for a part of `count` records (None: nothing, or no sidecar at all, which
    a part written without origins has by design): fewer whole rows, or a torn row at its end."""
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return None
    have, torn = divmod(size, ORIGIN_ROW_SIZE)
    if have >= count and not torn:
        return None
    lacking = f"holds {min(have, count)} of {count} rows"
    if have < count:
        lacking += f"; {count - have} read as origin lost"
    return lacking + (f"; ends in a torn row of {torn} bytes" if torn else "")


def read_origins(path: str | os.PathLike[str], count: int) -> tuple[np.ndarray, int]:
    """The first `count` rows of a sidecar, and how many of them failed their check; a missing file's
    are unknown (NO_QUEUE: a part written without origins), the rows that failed and those an existing
    sidecar does not have are lost (LOST_QUEUE: it had them once)."""
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return unknown_origins(count), 0
    have = min(count, size // ORIGIN_ROW_SIZE)
    rows = np.fromfile(path, dtype=ORIGIN_DTYPE, count=have) if have else np.empty(0, ORIGIN_DTYPE)
    bad = np.flatnonzero(~good_rows(rows))
    if len(bad):
        rows[bad] = lost_origins(len(bad))
    if have < count:
        rows = np.concatenate([rows, lost_origins(count - have)])
    return rows, len(bad)


class QueueTable:
    """Queue names (`broker:queue id`) and their numbers in this data directory (meta store document)."""

    def __init__(self, meta: object) -> None:
        self._meta = meta
        self._lock = threading.Lock()
        doc = meta.get_document(_DOCUMENT)  # type: ignore[attr-defined]
        self._names: list[str] = [str(n) for n in doc] if isinstance(doc, list) else []
        self._numbers = {name: i for i, name in enumerate(self._names)}

    def numbers(self, names: Sequence[str | None]) -> np.ndarray:
        """The number of each name (None: NO_QUEUE), adding new names to the table (saved first)."""
        with self._lock:
            distinct = dict.fromkeys(names)
            fresh = [n for n in distinct if n is not None and n not in self._numbers]
            if fresh:
                names_now = self._names + fresh
                # durably, before any row with a new number reaches a part: a checkpoint fsyncs the
                # parts before it flushes the meta store, and rows naming a number the table lost to a
                # power loss would name whichever queue takes that number next
                self._meta.put_document(_DOCUMENT, names_now, sync=True)  # type: ignore[attr-defined]
                self._names = names_now
                self._numbers = {name: i for i, name in enumerate(names_now)}
            numbers = self._numbers
            if not distinct:
                return np.empty(0, np.int32)
            if len(distinct) == 1:  # the usual commit: the rows of one queue's answer
                [only] = distinct
                return np.full(len(names), NO_QUEUE if only is None else numbers[only], np.int32)
            of = {n: NO_QUEUE if n is None else numbers[n] for n in distinct}
            return np.array(itemgetter(*names)(of), np.int32)  # two names at least: a tuple

    def names(self) -> list[str]:
        """Every known queue name, by number."""
        with self._lock:
            return list(self._names)


class OriginReader:
    """Origins of records by (segment, part, offset), through a small cache of sidecars and index offsets."""

    def __init__(self, layout: object) -> None:
        self._layout = layout
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = OrderedDict()
        #: rows found failing their check (read as lost), and how many of them each part had
        self.corrupt_rows = 0
        self._corrupt_in: dict[tuple[int, int], int] = {}

    def _part(self, seg: int, part: int, need: int) -> tuple[np.ndarray, np.ndarray]:
        """(index offsets, origin rows) of a part, read again when `need` lies past what is cached."""
        key = (seg, part)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and len(hit[0]) and int(hit[0][-1]) >= need:
                self._cache.move_to_end(key)
                return hit
        idx_path = Path(self._layout.part_index(seg, part))  # type: ignore[attr-defined]
        offsets = read_index(idx_path)["offset"].astype(np.int64)
        org_path = idx_path.with_suffix(ORIGIN_SUFFIX)
        rows, bad = read_origins(org_path, len(offsets))
        with self._lock:
            if bad > self._corrupt_in.get(key, 0):  # a part read again tells only of rows not told yet
                log.warning("origin sidecar %s: %d row(s) fail their CRC32C (damage, or data a power loss"
                            " did not keep); read as origin lost", org_path, bad)
                self.corrupt_rows += bad - self._corrupt_in.get(key, 0)
                self._corrupt_in[key] = bad
            self._cache[key] = (offsets, rows)
            self._cache.move_to_end(key)
            while len(self._cache) > _CACHED_PARTS:
                self._cache.popitem(last=False)
        return offsets, rows

    def read(self, segs: np.ndarray, parts: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """ORIGIN_DTYPE rows aligned with the given locations (unknown where the sidecar says nothing)."""
        out = unknown_origins(len(segs))
        if not len(segs):
            return out
        key = (segs.astype(np.int64) << 16) | parts.astype(np.int64)
        for k in np.unique(key):
            m = np.flatnonzero(key == k)
            seg, part = int(segs[m[0]]), int(parts[m[0]])
            want = offsets[m].astype(np.int64)
            idx_off, rows = self._part(seg, part, int(want.max()))
            if not len(idx_off):
                continue
            pos = np.minimum(np.searchsorted(idx_off, want), len(idx_off) - 1)
            found = idx_off[pos] == want
            out[m[found]] = rows[pos[found]]
        return out

    def forget(self, seg: int) -> None:
        """Drop the cached parts of a segment (retired or released)."""
        with self._lock:
            for key in [k for k in self._cache if k[0] == seg]:
                del self._cache[key]

