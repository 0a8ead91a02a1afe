"""Records a settled part cannot give back: what the audit fails on and an export reports.

The readers take a part's records as the engine does (`storage.trusted_index`): index entries past
the end of the log are left out, and a part without its index sidecar names no records. Beside a
running engine a part may be read mid-write; but a part of a segment that ended before the audit's
grace window (`settled`) is appended to by nothing that could leave it so, and then both are
damage: the index names records whose bytes the log does not hold, or the log holds records no
index names (`timewheel inspect --verify` reports the same parts as `tail_mismatch` and
`missing_index`). `part_damage` says how many records that is.

Log bytes past the last index entry are not counted, settled or not: a late message is stored in
the past segment it is due in, its record written before its index entry, and the readers cannot
tell that write in flight from an index cut short without watching the part (`check()` does).
"""
from __future__ import annotations

import mmap
import os
from dataclasses import asdict, dataclass

import numpy as np

from spark._codec import segment_identity
from storage import INDEX_DTYPE, SegmentLayout, read_index
from storage.index import INDEX_ENTRY_SIZE
from storage.part import scan_log

#: how long after its segment ends a part is taken as settled when no grace is given (the audit's default)
GRACE_MS = 300_000


@dataclass(frozen=True, slots=True)
class PartDamage:
    """Records of one settled part that cannot be read, and why."""

    segment_ms: int
    part: int
    log: str
    records: int  # records due in the range asked for that no reader can give back
    offset: int  # where in the log the first of them starts
    reason: str

    @property
    def detail(self) -> str:
        """One line for an operator: how many records of which part, why, and where to look."""
        return (f"{self.records} record(s) of {self.log} cannot be read: {self.reason}; "
                "`timewheel inspect --verify` names the damage")

    def as_dict(self) -> dict:
        """Plain dict for JSON, with the detail."""
        return asdict(self) | {"detail": self.detail}


def settled(segment_ms: int, segment_length_ms: int, now_ms: int, grace_ms: int) -> bool:
    """Whether a segment ended at or before `now_ms - grace_ms` (a record due before then is lost if
    pending): its live parts are sealed, and a late message still stored into it is written record
    before index entry, never leaving a part as `part_damage` counts it."""
    return segment_ms + segment_length_ms <= now_ms - grace_ms


def part_damage(segment_ms: int, part: int, log: str, index: str, *, since_ms: int | None = None,
                until_ms: int | None = None) -> PartDamage | None:
    """The records of a settled part due in [since_ms, until_ms) that cannot be read; None when
    there are none, or when the segment was retired while it was looked at (its records were done).

    One entry of the index is read when the index ends within the log (the usual part); the whole
    index when it does not, and the whole log, as recovery would scan it, when there is no index.
    """
    segment = segment_identity(log)
    try:
        size = os.path.getsize(log)  # before the index: the engine makes a part's sidecars before its records
    except FileNotFoundError:
        return None
    past = _entries_past(index, size)
    if past is None:
        found = _whole_records(log) if size else None
        if found is None:
            return None  # claimed and not written yet, or retired meanwhile
        dues, torn = found
        n = int(_in_range(dues, since_ms, until_ms).sum()) + torn
        damage = PartDamage(segment_ms, part, log, n, 0, f"it has no index sidecar ({index})") if n else None
    else:
        past = past[_in_range(past["due_ms"], since_ms, until_ms)]
        damage = PartDamage(segment_ms, part, log, len(past), int(past["offset"][0]),
                            f"the index names them past the end of the log ({size} bytes)") if len(past) else None
    if segment is None or segment_identity(log) != segment:
        return None
    return damage


def damaged_parts(layout: SegmentLayout, *, now_ms: int, grace_ms: int = GRACE_MS, since_ms: int | None = None,
                  until_ms: int | None = None) -> list[PartDamage]:
    """`part_damage` of every settled part of the segments overlapping [since_ms, until_ms)."""
    out = []
    for seg in layout.list_segments(since_ms, until_ms):
        if not settled(seg, layout.segment_ms, now_ms, grace_ms):
            continue
        try:
            parts = layout.list_parts(seg)
        except FileNotFoundError:
            continue  # retired after it was listed: its records were done
        for p in parts:
            found = part_damage(seg, p, str(layout.part_log(seg, p)), str(layout.part_index(seg, p)),
                                since_ms=since_ms, until_ms=until_ms)
            if found is not None:
                out.append(found)
    return out


def _entries_past(index: str, log_size: int) -> np.ndarray | None:
    """Index entries whose record runs past `log_size` bytes; None when the index is missing."""
    try:
        n = os.path.getsize(index) // INDEX_ENTRY_SIZE
    except FileNotFoundError:
        return None
    if n:
        last = np.fromfile(index, INDEX_DTYPE, count=1, offset=(n - 1) * INDEX_ENTRY_SIZE)
        if len(last) and int(last["offset"][0]) + int(last["length"][0]) > log_size:
            idx = read_index(index)
            return idx[idx["offset"].astype(np.int64) + idx["length"] > log_size]
    return np.empty(0, INDEX_DTYPE)


def _whole_records(log: str) -> tuple[np.ndarray, int] | None:
    """Due times of the whole records a scan of a log finds (as recovery rebuilding its index
    would), and 1 when bytes that are no whole record follow them; None when the log is gone."""
    try:
        f = open(log, "rb")
    except FileNotFoundError:
        return None
    with f:
        size = os.fstat(f.fileno()).st_size  # as it is now: a map past the end could not be made
        if not size:
            return np.empty(0, np.int64), 0
        with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as mm:
            scan = scan_log(mm, 0)
    return scan.entries["due_ms"], int(scan.end < size)


def _in_range(due_ms: np.ndarray, since_ms: int | None, until_ms: int | None) -> np.ndarray:
    """Which due times fall in [since_ms, until_ms)."""
    keep = np.ones(len(due_ms), bool)
    if since_ms is not None:
        keep &= due_ms >= since_ms
    if until_ms is not None:
        keep &= due_ms < until_ms
    return keep
