"""Self-audit of a data directory: per-segment counters (`summarize`) and findings (`check`).

Both read files only (index sidecars, part logs, dispatch logs; `check` also reads the meta store
through, opened read-only), so they run beside a live engine. There a part or dispatch log being
appended can be read between two writes: a tail that does not agree is reported only if the file
then stands still for `SETTLE_SECONDS` (else it is counted in `tails_in_flight`), and a segment's
dispatch log is read before its parts, so every entry names a record already indexed. `check(fix=True)` applies the
repairs recovery would, beside a running engine too: a part's tail only under the part's lock
(which the engine holds while it has the part open) once it stands still, a dispatch log's torn
tail only under the log's lock once it stands still; any other is counted in `tails_in_flight`.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from storage import dispatch as _dispatch
from storage._dispatch_writer import append_dispatch, cut_dispatch_tail
from storage._files import size_of
from storage._leftovers import Leftover, leftover_at
from storage._meta_check import meta_store_findings
from storage._sidecar_check import SETTLE_SECONDS, Looked, look_at_leftover, look_at_origins, moving
from storage.index import INDEX_ENTRY_SIZE, read_index
from storage.layout import (DISPATCH_LOG_NAME, PART_INDEX_SUFFIX, PART_LOG_SUFFIX, SegmentLayout,
                            parse_segment_name, segment_name)
from storage.origin import ORIGIN_SUFFIX, read_origins
from storage.part import repair_part, still_part, trusted_index
from storage.record_reader import check_records

#: told (segments done, segments in all) as a long audit goes
SegmentProgress = Callable[[int, int], None]


@dataclass(slots=True)
class SegmentSummary:
    """Counters of one segment, as `timewheel inspect` prints them."""

    segment: str
    start_ms: int
    parts: int = 0
    records: int = 0
    dispatched: int = 0
    cancelled: int = 0
    dead_lettered: int = 0
    corrupt: int = 0
    pending: int = 0
    bytes: int = 0

    def as_dict(self) -> dict[str, int | str]:
        """Plain dict for JSON."""
        return asdict(self)


_COUNTED = ("parts", "records", "dispatched", "cancelled", "dead_lettered", "corrupt", "pending", "bytes")


def record_keys(part: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """part << 32 | offset as uint64: one sortable key per record of a segment."""
    return (part.astype(np.uint64) << np.uint64(32)) | offset.astype(np.uint64)


def sorted_unique(keys: np.ndarray) -> np.ndarray:
    """Sorted distinct values (numpy's hash-based np.unique is several times slower on 1M keys)."""
    s = np.sort(keys)
    return s[np.concatenate(([True], s[1:] != s[:-1]))] if len(s) else s


def done_keys(entries: np.ndarray) -> dict[int, np.ndarray]:
    """Sorted distinct record keys per terminal outcome in dispatch entries."""
    out = {}
    for outcome in _dispatch.TERMINAL:
        sel = entries[entries["outcome"] == outcome]
        out[outcome] = sorted_unique(record_keys(sel["part"], sel["offset"]))
    return out


#: per-record outcome counts: how many dispatch entries of each outcome name the record
OUTCOME_COUNTS = {"delivered": _dispatch.DELIVERED, "dead_lettered": _dispatch.DEAD_LETTERED,
                  "cancelled": _dispatch.CANCELLED, "marked_corrupt": _dispatch.CORRUPT,
                  "replayed": _dispatch.REPLAYED}
#: a record's status, by code (`record_status`); every record has exactly one
STATUSES = ("dispatched", "cancelled", "dead_lettered", "corrupt", "pending")
DISPATCHED, CANCELLED_STATUS, DEAD_LETTERED_STATUS, CORRUPT_STATUS, PENDING = range(len(STATUSES))
NO_TIME = np.iinfo(np.int64).max  # first_delivered_ms of a record never delivered


@dataclass(slots=True)
class Outcomes:
    """What the dispatch entries of a segment say of some of its records (aligned with their keys)."""

    counts: dict[str, np.ndarray]  # OUTCOME_COUNTS name -> int32 per record
    first_delivered_ms: np.ndarray  # int64 per record, NO_TIME when never delivered
    entry_hit: np.ndarray  # bool per entry: it names one of the records


def known_keys(parts: Sequence[tuple[int, str | os.PathLike[str], str | os.PathLike[str]]]) -> np.ndarray:
    """Sorted record keys of parts given as (number, log, index): their index entries as far as they
    agree with the log (`trusted_index`), as every reader takes them."""
    keys = []
    for part, log, index in parts:
        idx = trusted_index(Path(log), read_index(Path(index)))
        keys.append(record_keys(np.full(len(idx), part), idx["offset"]))
    return np.sort(np.concatenate(keys)) if keys else np.empty(0, np.uint64)


def outcomes_of(keys: np.ndarray, entries: np.ndarray) -> Outcomes:
    """Per record (`record_keys`, ascending), its outcome counts and first delivery time, from
    dispatch entries; entries naming none of the records are flagged in `entry_hit`."""
    n = len(keys)
    if n and len(entries):
        ek = record_keys(entries["part"], entries["offset"])
        pos = np.minimum(np.searchsorted(keys, ek), n - 1)
        hit = keys[pos] == ek
    else:
        pos, hit = np.zeros(len(entries), np.int64), np.zeros(len(entries), bool)
    pos, outcome, dispatch_ms = pos[hit], entries["outcome"][hit], entries["dispatch_ms"][hit]
    counts = {name: np.bincount(pos[outcome == code], minlength=n).astype(np.int32)
              for name, code in OUTCOME_COUNTS.items()}
    first = np.full(n, NO_TIME, np.int64)
    sel = outcome == _dispatch.DELIVERED
    np.minimum.at(first, pos[sel], dispatch_ms[sel].astype(np.int64))
    return Outcomes(counts, first, hit)


def record_status(counts: dict[str, np.ndarray], bad: np.ndarray | None = None) -> np.ndarray:
    """Status code (index into STATUSES) of each record: bad bytes (`bad`) make it corrupt; else
    the first of cancelled, delivered, dead-lettered, marked corrupt that happened; else pending."""
    status = np.full(len(counts["delivered"]), PENDING, np.uint8)
    # assigned lowest precedence first, so each later line overrides the ones before it
    for name, code in (("marked_corrupt", CORRUPT_STATUS), ("dead_lettered", DEAD_LETTERED_STATUS),
                       ("delivered", DISPATCHED), ("cancelled", CANCELLED_STATUS)):
        status[counts[name] > 0] = code
    if bad is not None:
        status[bad] = CORRUPT_STATUS
    return status


def summarize_segment(layout: SegmentLayout, start_ms: int,
                      unreadable: list[Finding] | None = None) -> SegmentSummary:
    """Counters of one segment from its index sidecars and dispatch log. A file that cannot be read
    raises (retention must not take a segment it could not read for done), unless `unreadable` is
    given: it is added there and the rest counted (the part not at all; without its dispatch log,
    every record of the segment as pending)."""
    s = SegmentSummary(segment_name(start_ms), start_ms)
    seg_dir = layout.segment_dir(start_ms)
    keys = []
    try:
        parts = layout.list_parts(start_ms)
    except OSError as e:
        if unreadable is None:
            raise
        _add(unreadable, _unreadable(e, seg_dir, seg_dir))
        return s
    for part in parts:
        log, idx_path = layout.part_log(start_ms, part), layout.part_index(start_ms, part)
        try:
            idx = trusted_index(log, read_index(idx_path))
        except OSError as e:
            if unreadable is None:
                raise
            _add(unreadable, _unreadable(e, idx_path, seg_dir))
            continue
        s.parts += 1
        s.records += len(idx)
        s.bytes += size_of(log) + size_of(idx_path)
        keys.append(record_keys(np.full(len(idx), part), idx["offset"]))
    dl = layout.dispatch_log(start_ms)
    s.bytes += size_of(dl)
    all_keys = np.sort(np.concatenate(keys)) if keys else np.empty(0, np.uint64)
    try:
        entries = _dispatch.read_dispatch_log(dl).entries
    except OSError as e:
        if unreadable is None:
            raise
        _add(unreadable, _unreadable(e, dl, seg_dir))
        entries = np.empty(0, _dispatch.DISPATCH_DTYPE)
    # an outcome only counts for a record that exists; precedence as record_status says
    status = record_status(outcomes_of(all_keys, entries).counts)
    n = np.bincount(status, minlength=len(STATUSES))
    s.dispatched, s.cancelled, s.dead_lettered, s.corrupt, s.pending = (int(n[i]) for i in range(len(STATUSES)))
    return s


def summarize(layout: SegmentLayout, *, progress: SegmentProgress | None = None) -> dict[str, object]:
    """Per-segment counters, their totals and the files that could not be read: {"segments": [...],
    "totals": {...}, "findings": [...]} (each finding `unreadable`, the rest counted without it);
    `progress` is told (done, of) after each segment."""
    unreadable: list[Finding] = []
    try:
        starts = layout.list_segments()
    except OSError as e:
        unreadable.append(Finding("unreadable", str(e.filename or layout.schedule_dir), _why(e)))
        starts = []
    segs = []
    for st in starts:
        segs.append(summarize_segment(layout, st, unreadable))
        if progress is not None:
            progress(len(segs), len(starts))
    totals = {k: sum(getattr(s, k) for s in segs) for k in _COUNTED}
    totals["segments"] = len(segs)
    return {"segments": [s.as_dict() for s in segs], "totals": totals,
            "findings": [asdict(f) for f in unreadable]}


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing `check` found: a kind, where, and what."""

    kind: str
    path: str
    detail: str


@dataclass(slots=True)
class CheckReport:
    """Findings and counters of a self-audit."""

    findings: list[Finding] = field(default_factory=list)
    segments: int = 0
    parts: int = 0
    records: int = 0
    corrupt_records: int = 0
    dispatch_entries: int = 0
    fixed: int = 0
    tails_in_flight: int = 0  # files whose tail was being written while read (beside a running engine)

    @property
    def ok(self) -> bool:
        """True when nothing was found."""
        return not self.findings


def check(layout: SegmentLayout, *, fix: bool = False, now_ms: int = 0,
          progress: SegmentProgress | None = None) -> CheckReport:
    """Audit every segment: files, index against log, every record (`storage.record_reader`), dispatch
    logs; and the meta store, read through (`corrupt_meta_store`: the table file RocksDB found damaged).

    With fix=True: repairs index/log tails that stand still and no writer holds (see the module
    header), and so settles a sidecar's copy a crash left (`leftover_copy`) and mends an origin sidecar
    short of its index; marks corrupt records CORRUPT in the dispatch log so they are never served.
    A file that cannot be read (a directory where a log belongs, a mode that keeps this user out, a
    failing disk) is an `unreadable` finding, and the rest is checked. `progress` is told (done, of)
    after each segment.
    """
    rep = CheckReport()
    rep.findings += [Finding(*found) for found in meta_store_findings(layout.meta_dir)]
    root = layout.schedule_dir
    try:
        if root.exists():
            with os.scandir(root) as found:
                for e in found:
                    if not e.is_dir() or parse_segment_name(e.name) is None:
                        rep.findings.append(Finding("unknown_file", e.path, "not a segment directory"))
        starts = layout.list_segments()
    except OSError as e:
        rep.findings.append(Finding("unreadable", str(e.filename or root), _why(e)))
        return rep
    for start in starts:
        rep.segments += 1
        _check_segment(layout, start, rep, fix, now_ms)
        if progress is not None:
            progress(rep.segments, len(starts))
    return rep


def _check_segment(layout: SegmentLayout, start: int, rep: CheckReport, fix: bool, now_ms: int) -> None:
    """`check` of one segment: its findings and counts are added to `rep`."""
    seg_dir = layout.segment_dir(start)
    try:
        parts = set(layout.list_parts(start))
        with os.scandir(seg_dir) as found:
            names = [(e.name, e.path) for e in found]
    except OSError as e:
        _add(rep.findings, _unreadable(e, seg_dir, seg_dir))
        return
    leftovers: list[Leftover] = []
    for name, path in names:
        stem, dot, suffix = name.partition(".")
        if name == DISPATCH_LOG_NAME or name.startswith("_staging"):
            continue
        if (leftover := leftover_at(Path(path))) is not None:  # a sidecar's copy a crash left
            if int(stem) in parts:
                leftovers.append(leftover)
            else:
                rep.findings.append(Finding("orphan_index", path, "copy of a sidecar without its part"))
            continue
        if dot and "." + suffix in (PART_LOG_SUFFIX, PART_INDEX_SUFFIX, ORIGIN_SUFFIX) and stem.isdigit():
            if "." + suffix == PART_INDEX_SUFFIX and int(stem) not in parts:
                rep.findings.append(Finding("orphan_index", path, "index sidecar without its part"))
            if "." + suffix == ORIGIN_SUFFIX and int(stem) not in parts:
                rep.findings.append(Finding("orphan_index", path, "origin sidecar without its part"))
            continue
        rep.findings.append(Finding("unknown_file", path, "not a part, index or dispatch log"))
    for leftover in leftovers:  # before its part is read: an origin sidecar's copy may be its only rows
        _tally(rep, look_at_leftover(leftover, fix))
    # the dispatch log before the parts: every entry in it names a record indexed before it was
    # dispatched, so the parts read after it know them all, even as a running engine writes both
    dl = layout.dispatch_log(start)
    dl_size = size_of(dl)
    read: _dispatch.DispatchLogRead | None = None
    try:
        read = _dispatch.read_dispatch_log(dl)
    except OSError as e:
        _add(rep.findings, _unreadable(e, dl, seg_dir))
    existing_keys = []
    unread_parts = []
    corrupt_here: list[tuple[int, int, int]] = []
    for part in sorted(parts):
        rep.parts += 1
        try:
            existing_keys.append(_check_part(layout, start, part, rep, fix, corrupt_here))
        except OSError as e:
            _add(rep.findings, _unreadable(e, layout.part_log(start, part), seg_dir))
            unread_parts.append(part)
    if read is None:
        return  # no entries to compare, and no CORRUPT mark can be added to a log that cannot be read
    rep.dispatch_entries += len(read.entries)
    if read.corrupt_frames:
        rep.findings.append(Finding("corrupt_dispatch_frame", str(dl),
                                    f"{read.corrupt_frames} frame(s) fail their CRC32C; their entries are ignored"))
    if read.torn_bytes and not fix and moving([dl], (dl_size,)):
        rep.tails_in_flight += 1  # a frame being appended
    elif read.torn_bytes and fix and not cut_dispatch_tail(dl):
        rep.tails_in_flight += 1  # a frame in flight when read: whole under the lock, or still moving
    elif read.torn_bytes:
        rep.findings.append(Finding("torn_dispatch_log", str(dl), f"{read.torn_bytes} bytes after the last whole frame"))
        rep.fixed += int(fix)
    if len(read.entries):
        known = np.concatenate(existing_keys) if existing_keys else np.empty(0, np.uint64)
        # an entry of a part that could not be read is not known to name nothing
        stray = (~np.isin(record_keys(read.entries["part"], read.entries["offset"]), known)
                 & ~np.isin(read.entries["part"], unread_parts))
        if stray.any():
            rep.findings.append(Finding("unknown_dispatch_entry", str(dl),
                                        f"{int(stray.sum())} entries name no record of this segment"))
    if fix and corrupt_here:
        already = done_keys(read.entries)[_dispatch.CORRUPT]
        todo = [(p, o, d) for p, o, d in corrupt_here
                if not np.isin(record_keys(np.array([p]), np.array([o])), already).any()]
        if todo:
            arr = np.array(todo, dtype=np.int64)
            entries = _dispatch.dispatch_entries(arr[:, 0], arr[:, 1], arr[:, 2], now_ms, _dispatch.CORRUPT, 0)
            append_dispatch(layout, start, entries, now_ms)
            rep.fixed += len(todo)


def _check_part(layout: SegmentLayout, start: int, part: int, rep: CheckReport, fix: bool,
                corrupt_here: list[tuple[int, int, int]]) -> np.ndarray:
    """`check` of one part: its findings and counts are added to `rep` (only once all of it was
    read), its corrupt records to `corrupt_here`; returns its record keys."""
    log, idx_path = layout.part_log(start, part), layout.part_index(start, part)
    sizes = (size_of(log), size_of(idx_path))
    tail: list[Finding] | None = _part_tail_findings(log, idx_path, fix=False)
    if tail and fix:
        tail = _repair_still_tail(log, idx_path)
    elif tail and moving([log, idx_path], sizes):
        tail = None
    idx = read_index(idx_path)
    org = layout.part_origin(start, part)
    _, bad_origins = read_origins(org, len(idx))
    data = log.read_bytes() if log.exists() else b""
    # entries past the end of the log were reported as a tail mismatch
    whole = idx[idx["offset"].astype(np.int64) + idx["length"] <= len(data)]
    found = check_records(data, whole["offset"], due_ms=whole["due_ms"], lengths=whole["length"])
    if tail is None:
        rep.tails_in_flight += 1  # a running engine is writing this part: its tail is not settled
    else:
        rep.findings += tail
        rep.fixed += int(fix) * sum(f.kind in ("bad_index", "tail_mismatch") for f in tail)
    rep.records += len(whole)
    for row, err in sorted(found.errors.items()):
        off, due = int(whole["offset"][row]), int(whole["due_ms"][row])
        rep.corrupt_records += 1
        corrupt_here.append((part, off, due))
        rep.findings.append(Finding("corrupt_record", str(log), f"offset {off}: {err.reason}"))
    if bad_origins:  # read as origin lost, never as an origin they do not hold
        rep.findings.append(Finding("corrupt_origin", str(org),
                                    f"{bad_origins} row(s) fail their CRC32C; read as origin lost"))
    if tail is not None:  # a part in flight is counted above
        _tally(rep, look_at_origins(log, idx_path, org, len(idx), fix))
    return record_keys(np.full(len(idx), part), idx["offset"])


def _why(e: OSError) -> str:
    return f"cannot be read: {e.strerror or e}"


def _unreadable(e: OSError, path: Path, seg_dir: Path) -> Finding | None:
    """The finding for a file of a segment that could not be read (the one the error names, else
    `path`); None when its segment is gone: retention retired it while it was read."""
    if isinstance(e, FileNotFoundError) and not seg_dir.exists():
        return None
    return Finding("unreadable", str(e.filename or path), _why(e))


def _add(findings: list[Finding], finding: Finding | None) -> None:
    if finding is not None:
        findings.append(finding)


def _tally(rep: CheckReport, looked: Looked) -> None:
    """Add what a look at a part's sidecars found (`storage._sidecar_check`) to `rep`."""
    _add(rep.findings, None if looked.found is None else Finding(*looked.found))
    rep.fixed += looked.fixed
    rep.tails_in_flight += looked.in_flight


def _part_tail_findings(log: Path, idx_path: Path, fix: bool) -> list[Finding]:
    """What does not agree at the end of a part: its index against its log (repaired with `fix`)."""
    out = []
    if not idx_path.exists():
        out.append(Finding("missing_index", str(idx_path), "part has no index sidecar"))
    elif size_of(idx_path) % INDEX_ENTRY_SIZE:
        out.append(Finding("torn_index", str(idx_path), "index ends in a partial entry"))
    tail = repair_part(log, idx_path, fix=fix)
    if tail.bad_index:
        out.append(Finding(
            "bad_index", str(idx_path),
            f"{tail.bad_index}; {tail.index_dropped} entries from there on "
            + ("were rebuilt from the log" if fix else "are to be rebuilt from the log (fix=True)")))
    elif tail.changed:
        out.append(Finding(
            "tail_mismatch", str(log),
            f"index entries past the log: {tail.index_dropped}; unindexed whole records: "
            f"{tail.index_added}; torn/corrupt tail bytes: {tail.log_bytes_cut}"
            + (f" ({tail.reason})" if tail.reason else "")))
    return out


def _repair_still_tail(log: Path, idx_path: Path) -> list[Finding] | None:
    """A part's tail repaired under its lock once it stood still for `SETTLE_SECONDS`, and what was
    repaired; None when the engine has the part open or it changed: a commit in flight, never cut."""
    with still_part(log, SETTLE_SECONDS) as still:
        return _part_tail_findings(log, idx_path, fix=True) if still else None


def data_dir_bytes(path: Path) -> int:
    """Total bytes under a directory."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
