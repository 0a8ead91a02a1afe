"""`check()`'s look at a part's sidecars past its index: copies a crash left beside the part
(`storage._leftovers`), and an origin sidecar shorter than its index or ending in a torn row. Beside a
running engine, what moves while it is watched is a write in flight, not damage; `fix` mends only under
the part's lock, once its files stand still (`storage.part.still_part`), as a part's tail is repaired.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from storage._files import size_of
from storage._leftovers import Leftover, settle
from storage.index import INDEX_ENTRY_SIZE
from storage.origin import ORIGIN_ROW_SIZE, align_rows, shortfall
from storage.part import still_part

#: how long a file whose tail disagrees is watched for a write in flight before the tail is reported
SETTLE_SECONDS = 0.5


@dataclass(frozen=True, slots=True)
class Looked:
    """What one look found: a finding as (kind, path, detail) or none, whether it was fixed, whether
    what it looked at was being written (counted in `tails_in_flight`, not reported)."""

    found: tuple[str, str, str] | None = None
    fixed: bool = False
    in_flight: bool = False


def moving(paths: Sequence[Path], sizes: Sequence[int]) -> bool:
    """Whether any of `paths` changed size from `sizes` within `SETTLE_SECONDS`: a running engine is
    writing it, so a tail that does not agree is a write in flight, not damage."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        if [size_of(p) for p in paths] != list(sizes):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)


def look_at_leftover(leftover: Leftover, fix: bool) -> Looked:
    """A copy left beside a part: named with what `fix` does (`leftover_copy`), or settled with `fix`.
    One the engine's writer is making (renamed into place a moment later) is in flight."""
    if fix:
        with still_part(leftover.log, SETTLE_SECONDS) as still:
            if not still or not os.path.lexists(leftover.path):
                return Looked(in_flight=True)
            return Looked(("leftover_copy", str(leftover.path), settle(leftover)), fixed=True)
    if moving([leftover.path], [size_of(leftover.path)]) or not os.path.lexists(leftover.path):
        return Looked(in_flight=True)
    return Looked(("leftover_copy", str(leftover.path), leftover.plan()))


def look_at_origins(log: Path, index: Path, origins: Path, entries: int, fix: bool) -> Looked:
    """An origin sidecar that lacks rows for a part of `entries` index entries, or ends in a torn row
    (`corrupt_origin`); with `fix`, the torn row is cut and the rows it lacks written as lost, as the
    writer does before its next commit (`storage.origin.align_rows`): read as before, and whole again."""
    if not shortfall(origins, entries):
        return Looked()
    if fix:
        with still_part(log, SETTLE_SECONDS) as still:
            if not still:
                return Looked(in_flight=True)
            return _mended(index, origins)
    if moving([index, origins], [size_of(index), size_of(origins)]):
        return Looked(in_flight=True)  # a commit's rows being written
    # read again standing still: a failed commit cut back between the two reads is no shortfall
    short = shortfall(origins, size_of(index) // INDEX_ENTRY_SIZE)
    cut = "cuts its torn row and " if size_of(origins) % ORIGIN_ROW_SIZE else ""
    return Looked(("corrupt_origin", str(origins), f"{short}; fix=True {cut}writes the rows it lacks as lost")
                  if short else None)


def _mended(index: Path, origins: Path) -> Looked:
    """`look_at_origins` under the part's lock: the sidecar made one row per index entry, fsynced."""
    rows = size_of(index) // INDEX_ENTRY_SIZE
    short = shortfall(origins, rows)
    if not short:
        return Looked()
    torn = size_of(origins) % ORIGIN_ROW_SIZE
    fd = os.open(origins, os.O_WRONLY)
    try:
        lost = align_rows(fd, rows)
        os.fsync(fd)
    finally:
        os.close(fd)
    mended = f"{lost} row(s) written as origin lost" + (f", a torn row of {torn} bytes cut" if torn else "")
    return Looked(("corrupt_origin", str(origins), f"{short}; mended: {mended}"), fixed=True)
