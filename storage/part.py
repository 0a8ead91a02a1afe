"""Reading and repairing one part: its records (.log) against its index sidecar (.idx).

A part has one writer, the engine, which holds an exclusive `flock` of the part's record file for as
long as it has the part open to append (`PartWriter`); a repair from outside it (`check(fix=True)`)
takes that lock without waiting, or leaves the part alone (`still_part`).
"""
from __future__ import annotations

import contextlib
import logging
import mmap
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np

from storage.errors import CorruptRecordError
from storage.index import INDEX_DTYPE, INDEX_ENTRY_SIZE, index_entries, read_index
from storage.layout import PART_INDEX_SUFFIX
from storage.origin import ORIGIN_ROW_SIZE, ORIGIN_SUFFIX, align_rows
from storage.record import HEADER_SIZE, LENGTH_AT, header_fields, record_length
from storage._files import lock_exclusive, size_of, write_all

log = logging.getLogger("timewheel.storage")
#: what a filesystem without `flock` leaves unsafe (said once)
UNSAFE_WITHOUT_PART_LOCKS = "`check(fix=True)` repairing a part the engine is appending to"


@dataclass(frozen=True, slots=True)
class ScanResult:
    """What a scan of a .log from some offset found: whole records, then where it stopped."""

    entries: np.ndarray
    end: int
    stopped_because: str | None
    damaged: int = 0  # records indexed although their CRC fails (a valid record follows them)


def _valid_at(buf: bytes | memoryview | mmap.mmap, pos: int) -> bool:
    """Whether a whole record with a matching CRC starts at `pos`."""
    try:
        return bool(header_fields(buf, pos)[2])  # type: ignore[arg-type]
    except CorruptRecordError:
        return False


def scan_log(buf: bytes | memoryview | mmap.mmap, start: int) -> ScanResult:
    """Walk records from `start`, validating each CRC, until the end or a torn or corrupt tail.

    A record whose CRC fails but whose length leads to a valid record is damage, not a torn
    tail: it is indexed (readers find it corrupt, and report it, and never serve it) so that the
    records after it are not cut. Its index due time is its successor's, its own being untrusted.
    """
    dues: list[int | None] = []
    offs, lens = [], []
    pos, n = start, len(buf)
    reason = None
    damaged = 0
    while pos < n:
        try:
            length, due, ok = header_fields(buf, pos)  # type: ignore[arg-type]
        except CorruptRecordError as e:
            reason = e.reason
            break
        if not ok and not (pos + length < n and _valid_at(buf, pos + length)):
            reason = "CRC32C mismatch"
            break
        damaged += not ok
        dues.append(due if ok else None)
        offs.append(pos)
        lens.append(length)
        pos += length
    for i in range(len(dues) - 2, -1, -1):  # a damaged record is always followed by a valid one
        if dues[i] is None:
            dues[i] = dues[i + 1]
    return ScanResult(index_entries(cast("list[int]", dues), offs, lens), pos, reason, damaged)


assert INDEX_DTYPE.fields is not None
_OFFSET_WORD = INDEX_DTYPE.fields["offset"][1] // 4  # where offset and length sit in an entry's words
_LENGTH_WORD = INDEX_DTYPE.fields["length"][1] // 4


def tiling_prefix(idx: np.ndarray, log_size: int) -> tuple[int, str | None]:
    """How many leading index entries can be trusted, and why the next one cannot.

    The records of a part lie back to back from offset 0, so its index entries tile the log: each
    starts where the one before ends, and none runs past the log. The first entry that breaks
    this is wrong, or the one before it is (a bad length moves the next start), so both go. An
    index whose only fault is entries past the end of the log (a torn write) loses just those.
    """
    n = len(idx)
    if not n:
        return 0, None
    # The entries as rows of four uint32 words: three passes over strided words cost a fraction of
    # field views cast to int64 (1M entries are loaded every hour). No valid end overflows uint32:
    # a part is at most MAX_PART_BYTES (2**32 - 1).
    words = np.ascontiguousarray(idx).view(np.uint32).reshape(n, INDEX_ENTRY_SIZE // 4)
    off, ln = words[:, _OFFSET_WORD], words[:, _LENGTH_WORD]
    ends = off + ln
    starts_ok = np.empty(n, bool)
    starts_ok[0] = off[0] == 0
    np.equal(off[1:], ends[:-1], out=starts_ok[1:])
    if int(ln.min()) < HEADER_SIZE:
        starts_ok &= ln >= HEADER_SIZE
    if not starts_ok.all():
        k = int(np.argmin(starts_ok))
        expected = int(off[k - 1]) + int(ln[k - 1]) if k else 0
        return max(k - 1, 0), (f"index entry {k} says offset {int(off[k])} length {int(ln[k])}; "
                               f"the entries must tile the log (expected offset {expected})")
    if int(off[-1]) + int(ln[-1]) <= log_size:
        return n, None
    return int(np.searchsorted(ends, log_size, side="right")), None


@dataclass(slots=True)
class PartRepair:
    """What `repair_part` changed."""

    index_rebuilt: bool = False
    index_added: int = 0
    index_dropped: int = 0
    log_bytes_cut: int = 0
    reason: str | None = None
    bad_index: str | None = None  # why entries that do not tile the log were dropped and re-scanned
    damaged: int = 0  # records indexed by the scan although their CRC fails (see `scan_log`)
    origin_rows_lost: int = 0  # origin sidecar rows written as lost to keep the sidecar one row per entry

    @property
    def changed(self) -> bool:
        """Whether anything was repaired."""
        return self.index_rebuilt or bool(self.index_added or self.index_dropped or self.log_bytes_cut)


def _read_log(path: Path, start: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(start)
        return f.read()


def repair_part(log_path: Path, idx_path: Path, *, fix: bool = True) -> PartRepair:
    """Make a part's index and log agree, looking only at the part's tail when the index exists.

    A missing index is rebuilt by scanning the log. Index entries past the end of the log are
    dropped, and so are entries from the first that does not tile the log (`tiling_prefix`).
    Log bytes past the last kept entry are scanned: whole valid records are indexed, and the first
    torn or corrupt byte onwards is cut.
    """
    rep = PartRepair()
    log_size = size_of(log_path)
    scan: ScanResult | None
    if not idx_path.exists():
        scan = scan_log(_read_log(log_path, 0), 0) if log_size else ScanResult(np.empty(0, INDEX_DTYPE), 0, None)
        rep.index_rebuilt = True
        rep.index_added = len(scan.entries)
        rep.log_bytes_cut = log_size - scan.end
        rep.reason = scan.stopped_because
        rep.damaged = scan.damaged
        if fix:
            rep.origin_rows_lost = _align_origins(idx_path, 0, len(scan.entries))  # nothing vouches for which record a row belonged to
            with open(idx_path, "wb") as f:
                f.write(scan.entries.tobytes())
            if rep.log_bytes_cut:
                os.truncate(log_path, scan.end)
        return rep
    idx_size = size_of(idx_path)
    idx = read_index(idx_path)
    keep, rep.bad_index = tiling_prefix(idx, log_size)
    rep.index_dropped = len(idx) - keep
    indexed_end = int(idx["offset"][keep - 1]) + int(idx["length"][keep - 1]) if keep else 0
    scan = None
    if log_size > indexed_end:
        buf = _read_log(log_path, 0)
        scan = scan_log(buf, indexed_end)
        rep.index_added = len(scan.entries)
        rep.log_bytes_cut = log_size - scan.end
        rep.reason = scan.stopped_because
        rep.damaged = scan.damaged
    if fix and (rep.index_dropped or rep.index_added or idx_size != keep * INDEX_ENTRY_SIZE):
        # before the index, as a commit writes them: rows of dropped entries (which did not tile the
        # log) may belong to other records; the rows after the kept ones are those of the records the
        # scan indexes, written before their entries
        rows = keep + rep.index_added
        rep.origin_rows_lost = _align_origins(idx_path, keep if rep.index_dropped else rows, rows)
        os.truncate(idx_path, keep * INDEX_ENTRY_SIZE)
        if scan is not None and len(scan.entries):
            fd = os.open(idx_path, os.O_WRONLY | os.O_APPEND)
            try:
                write_all(fd, scan.entries.tobytes())
            finally:
                os.close(fd)
    if fix and rep.log_bytes_cut and scan is not None:
        os.truncate(log_path, scan.end)
    return rep


@contextlib.contextmanager
def still_part(log_path: Path, settle_s: float) -> Iterator[bool]:
    """Held while a part is repaired from outside its writer: True once the part's lock is held and
    its files stood still for `settle_s`; False when a writer holds the lock or a file changed.

    The engine holds the lock for as long as it has the part open, and a commit writes its records,
    then their origins, then their index entries: a tail read between those writes looks torn or
    unindexed, and a repair then would cut the engine's record or index it twice. A writer that takes
    no lock (an older build; a filesystem without `flock`) is told apart by its files still moving.
    """
    try:
        fd = os.open(log_path, os.O_WRONLY | os.O_APPEND)  # some filesystems lock only what is open to write
    except FileNotFoundError:  # moved out with its segment meanwhile: nothing here to repair, nor damage to report
        fd = -1
    try:
        held = fd >= 0
        if held:
            try:
                lock_exclusive(fd, log_path, UNSAFE_WITHOUT_PART_LOCKS, timeout_s=0)
            except TimeoutError:  # the engine has it open: waiting could last as long as its segment
                held = False
        yield held and _stands_still(log_path, settle_s)
    finally:
        if fd >= 0:
            os.close(fd)  # lets the lock go


def _stands_still(log_path: Path, settle_s: float) -> bool:
    """Whether a part's record file and sidecars keep their sizes (or stay missing) for `settle_s`."""
    paths = (log_path, log_path.with_suffix(PART_INDEX_SUFFIX), log_path.with_suffix(ORIGIN_SUFFIX))

    def sizes() -> list[int]:
        return [_size_or_missing(p) for p in paths]

    before = sizes()
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline:
        time.sleep(min(0.02, settle_s))
        if sizes() != before:
            return False
    return True


def _size_or_missing(path: Path) -> int:
    """A file's size, -1 when it is missing (a sidecar about to be created is a change too)."""
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return -1


def _align_origins(idx_path: Path, keep: int, rows: int) -> int:
    """Keep at most the first `keep` rows of a part's origin sidecar (`storage.origin`) and make it
    `rows` rows long, one per index entry, the rows it lacks written as lost (as recovery writes the
    rows an OS crash took): they read as before, and the part is left whole. A part without one (written
    without origins) keeps none. Returns how many rows were written as lost."""
    try:
        fd = os.open(idx_path.with_suffix(ORIGIN_SUFFIX), os.O_WRONLY)
    except FileNotFoundError:
        return 0
    try:
        if os.fstat(fd).st_size > keep * ORIGIN_ROW_SIZE:
            os.ftruncate(fd, keep * ORIGIN_ROW_SIZE)
        return align_rows(fd, rows)
    finally:
        os.close(fd)


def trusted_index(log_path: Path, idx: np.ndarray) -> np.ndarray:
    """The entries of a part's index that agree with its log, without changing either file.

    Entries past the end of the log (a torn write not yet repaired) are left out. Where entries
    stop tiling the log, the rest come from a scan of the CRC-checked records instead (rare: a
    damaged index, until recovery or `check(fix=True)` rewrites it).
    """
    keep, bad = tiling_prefix(idx, size_of(log_path))
    if keep == len(idx):
        return idx
    if bad is None:
        return idx[:keep]
    log.warning("part %s: %s; reading its records from the log instead", log_path, bad)
    start = int(idx["offset"][keep - 1]) + int(idx["length"][keep - 1]) if keep else 0
    return np.concatenate((idx[:keep], scan_log(_read_log(log_path, 0), start).entries))


class PartReader:
    """Random access to the records of one part through a read-only mmap that follows growth."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._f = open(path, "rb")
        self._map: mmap.mmap | None = None
        self._size = 0

    def view(self, need_end: int) -> mmap.mmap:
        """A map covering at least `need_end` bytes (remapped when the live part has grown)."""
        if self._map is None or need_end > self._size:
            size = os.fstat(self._f.fileno()).st_size
            if size < need_end or size == 0:
                raise CorruptRecordError(f"part is {size} bytes, a record needs {need_end}", path=str(self.path))
            if self._map is not None:
                self._map.close()
            self._map = mmap.mmap(self._f.fileno(), size, access=mmap.ACCESS_READ)
            self._size = size
        return self._map

    def current(self) -> mmap.mmap | None:
        """The map as made so far (None: none yet); it may end before records the part has now."""
        return self._map

    def covering(self, offsets: np.ndarray) -> mmap.mmap:
        """A map holding the whole records at `offsets`: the one already made unless one of them runs
        past it (a live part grows under its reader; remapping for every read costs a map, an unmap
        and a page fault per page touched). Else `whole()`: a record past the file's end is then
        found corrupt on its own, by the caller."""
        m = self._map
        if m is not None and len(offsets):
            offs = np.asarray(offsets, np.int64)
            if int(offs.max()) + HEADER_SIZE <= self._size:
                raw = np.frombuffer(m, np.uint8)
                lengths = raw[offs[:, None] + np.arange(LENGTH_AT, LENGTH_AT + 4)].view("<u4")[:, 0]
                del raw  # the map is not held while it may be remapped
                if int((offs + lengths).max()) <= self._size:
                    return m
        return self.whole()

    def covering_few(self, offsets: list[int]) -> mmap.mmap:
        """`covering` for a few offsets given as ints, without numpy (a send of a few messages)."""
        m, size = self._map, self._size
        if m is not None and all(o + HEADER_SIZE <= size and o + record_length(m, o) <= size  # type: ignore[arg-type]
                                 for o in offsets):
            return m
        return self.whole()

    def whole(self) -> mmap.mmap:
        """A map covering the whole file as it is now (remapped when the live part has grown)."""
        return self.view(max(1, os.fstat(self._f.fileno()).st_size))

    def close(self) -> None:
        """Unmap and close."""
        if self._map is not None:
            self._map.close()
            self._map = None
        self._f.close()
