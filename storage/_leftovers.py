"""Copies of a part's sidecars a crash left beside it, and what becomes of them.

The writer makes an index or origin sidecar deleted while it held it open again (`storage._files.remake`):
every byte copied to `NNNNN.idx.tmp` or `NNNNN.org.tmp`, fsynced, renamed over the sidecar's name. A
crash between the copy and the rename leaves the copy. Where the origin sidecar is gone, its copy holds
the part's only origin rows: it is put in place, aligned first to the part's index as the writer aligns
a short sidecar (`storage.origin.align_rows`: a torn row and rows past the index cut, the rows it lacks
written as lost), its bytes fsynced before its name. Any other copy is removed: a sidecar at its name is
the one the writer and the readers use, and an index is made again from the part's CRC-checked records
where it falls short (`storage.part.repair_part`); one that is gone is made again empty first, so that
the part's origin rows, written in step with its records, stay with them (as when the writer indexes a
short index again) rather than read as lost, as a rebuilt index's rows must.

Recovery settles them (in the parts it checks, before it replays into them), the writer before it
opens a part's sidecars (which it would make, empty, if missing), `check(fix=True)` under the part's
lock; the segment directory is fsynced after each rename or unlink.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from storage._files import TEMPORARY_SUFFIX, fsync_path, size_of, temporary
from storage.index import INDEX_ENTRY_SIZE
from storage.layout import PART_INDEX_SUFFIX, PART_LOG_SUFFIX
from storage.origin import ORIGIN_SUFFIX, align_rows


@dataclass(frozen=True, slots=True)
class Leftover:
    """A copy a crash left beside a part: `path`, the copy of `sidecar`."""

    path: Path
    sidecar: Path

    @property
    def log(self) -> Path:
        """The record file of the part."""
        return self.sidecar.with_suffix(PART_LOG_SUFFIX)

    @property
    def adopted(self) -> bool:
        """Whether settling puts it in place (an origin sidecar's copy, the sidecar gone); else it is removed."""
        return self.sidecar.suffix == ORIGIN_SUFFIX and not os.path.lexists(self.sidecar)

    def plan(self) -> str:
        """What settling it will do, in the user's words."""
        what = f"a copy of {self.sidecar.name} a crash left while the sidecar was being made again"
        if self.adopted:
            return (f"{what}, and {self.sidecar.name} is gone: the part's only origin rows; fix=True puts it in "
                    "place (aligned to the index, the rows it lacks written as origin lost)")
        if self.sidecar.suffix == ORIGIN_SUFFIX:
            return f"{what}; {self.sidecar.name} is there: fix=True removes it"
        return f"{what}: fix=True removes it (the index is made again from the part's records where it falls short)"


def leftover_at(path: Path) -> Leftover | None:
    """The leftover `path` names (`NNNNN.idx.tmp`, `NNNNN.org.tmp`); None for any other name."""
    if not path.name.endswith(TEMPORARY_SUFFIX):
        return None
    sidecar = path.name[:-len(TEMPORARY_SUFFIX)]
    stem, _, suffix = sidecar.partition(".")
    if len(stem) != 5 or not stem.isdigit() or "." + suffix not in (PART_INDEX_SUFFIX, ORIGIN_SUFFIX):
        return None
    return Leftover(path, path.with_name(sidecar))


def leftovers_of(log_path: Path) -> list[Leftover]:
    """The copies left beside a part (one look for each of its two sidecars)."""
    out = []
    for suffix in (PART_INDEX_SUFFIX, ORIGIN_SUFFIX):
        sidecar = log_path.with_suffix(suffix)
        if os.path.lexists(temporary(sidecar)):
            out.append(Leftover(temporary(sidecar), sidecar))
    return out


def settle(leftover: Leftover) -> str:
    """Put a leftover in place or remove it (`Leftover.adopted`), durably; says what was done. The caller
    holds the part (recovery, its writer, or its lock): nothing else makes or renames its sidecars."""
    name = leftover.sidecar.name
    if leftover.adopted:
        rows, lost = _aligned(leftover.path, leftover.sidecar.with_suffix(PART_INDEX_SUFFIX))
        os.rename(leftover.path, leftover.sidecar)
        fsync_path(leftover.path.parent)
        held = (f"{rows} row(s), {lost} written as origin lost" if rows is not None
                else "its rows aligned once the index, gone, is made again")
        return f"a copy of {name} a crash left while it was being made again was put in place ({held})"
    os.unlink(leftover.path)
    made = leftover.sidecar.suffix == PART_INDEX_SUFFIX and not leftover.sidecar.exists() and leftover.log.exists()
    if made:
        os.close(os.open(leftover.sidecar, os.O_WRONLY | os.O_CREAT, 0o644))
    fsync_path(leftover.path.parent)
    return (f"a copy of {name} a crash left while it was being made again was removed"
            + ("; the index, gone, is made again from the part's records" if made else ""))


def settle_part(log_path: Path) -> list[str]:
    """Settle the copies left beside a part (`settle`); what was done, each naming its copy."""
    return [f"{leftover.path}: {settle(leftover)}" for leftover in leftovers_of(log_path)]


def _aligned(copy: Path, index: Path) -> tuple[int | None, int]:
    """Make an origin sidecar's copy one row per entry of the part's index (none when the index is gone:
    the index made again aligns it) and fsync it; (its rows, how many were written as lost)."""
    fd = os.open(copy, os.O_WRONLY)
    try:
        rows = size_of(index) // INDEX_ENTRY_SIZE if index.exists() else None
        lost = align_rows(fd, rows) if rows is not None else 0
        os.fsync(fd)
    finally:
        os.close(fd)
    return rows, lost
