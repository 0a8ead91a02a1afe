"""Where bytes live: segment directories named by their UTC start, part files, sidecars.

    <data_dir>/
      timewheel.json                 format version and segment length, checked on open
      schedule/<YYYYMMDDHHMM>/       one segment, named by its UTC start
        00000.log  00000.idx         part 0: records and their fixed-width index
        00001.log  00001.idx         another writer's part (engine after a restart, Spark backfill)
        dispatch.log                 what was delivered, cancelled or dead-lettered
      ingest/<seq>.wal               ingest log: one frame per group commit
      meta/                          rocksdict meta store
      archive/                       retired segments, when retention archives instead of deleting
      retiring/<YYYYMMDDHHMM>/       a segment being deleted by retention (moved here whole first;
                                     what a crash leaves here is deleted at the next open)
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from storage._files import fsync_path, lock_exclusive
from storage.errors import StorageError
from storage.origin import ORIGIN_SUFFIX

log = logging.getLogger("timewheel.storage")

#: what this build writes; 2 added the origin sidecar (.org) and TWD3 dispatch frames, which builds
#: of format 1 would misread (TWD3 frames as corrupt: their messages sent again), so opening a format-1
#: directory for writing marks it 2, and those builds then refuse it with a clear error instead
FORMAT_VERSION = 2
READABLE_FORMATS = frozenset({1, 2})
_NAME_FORMAT = "%Y%m%d%H%M"
#: segment paths a layout keeps made (`segment_dir`, `dispatch_log`)
_PATHS_KEPT = 256
PART_LOG_SUFFIX = ".log"
PART_INDEX_SUFFIX = ".idx"
DISPATCH_LOG_NAME = "dispatch.log"
MAX_PART = 0xFFFF
MARKER_NAME = "timewheel.json"


def read_marker(path: Path) -> dict[str, int]:
    """The data directory's metadata file, checked: {"format": int, "segment_minutes": int}.

    Raises StorageError naming the file and what to do when it cannot be read, is not JSON or
    holds fields of the wrong type.
    """
    fix = (f"restore it from a backup, or rewrite it as {{\"format\": {FORMAT_VERSION}, \"segment_minutes\": N}} "
           "with the segment length the directory was written with (its segment names are N minutes apart)")
    try:
        info = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:  # ValueError: JSON or UTF-8 errors
        raise StorageError(f"cannot read {path}: {e}; {fix}") from e
    if not isinstance(info, dict):
        raise StorageError(f"{path} holds {type(info).__name__}, not a JSON object; {fix}")
    for key in ("format", "segment_minutes"):
        value = info.get(key)
        if type(value) is not int:  # bool is an int subclass, and no answer here
            raise StorageError(f"{path}: {key!r} is {value!r}, not an integer; {fix}")
    return {"format": info["format"], "segment_minutes": info["segment_minutes"]}


def segment_name(start_ms: int) -> str:
    """Directory name of the segment starting at `start_ms` (UTC, minute precision)."""
    return datetime.fromtimestamp(start_ms / 1000, tz=timezone.utc).strftime(_NAME_FORMAT)


def parse_segment_name(name: str) -> int | None:
    """UTC start in epoch ms of a segment directory name, or None if it is not one."""
    if len(name) != 12 or not name.isdigit():
        return None
    try:
        dt = datetime.strptime(name, _NAME_FORMAT).replace(tzinfo=timezone.utc)
    except ValueError:
        return None
    return int(dt.timestamp()) * 1000


def part_name(part: int) -> str:
    """File stem of part number `part` inside a segment."""
    return f"{part:05d}"


class SegmentLayout:
    """The directory tree of one data directory, and the arithmetic of segment boundaries."""

    def __init__(self, data_dir: str | os.PathLike[str], segment_minutes: int = 60, *, create: bool = True) -> None:
        if segment_minutes <= 0 or 1440 % segment_minutes:
            raise StorageError(f"segment_minutes={segment_minutes} must divide a day (1440 minutes)")
        self.root = Path(data_dir)
        self.segment_minutes = segment_minutes
        self.segment_ms = segment_minutes * 60_000
        self.schedule_dir = self.root / "schedule"
        self.ingest_dir = self.root / "ingest"
        self.meta_dir = self.root / "meta"
        self.archive_dir = self.root / "archive"
        self.retiring_dir = self.root / "retiring"
        # every send records its outcomes in its segment's dispatch log: the paths are made once, not
        # per send (a few segments are in use at a time; the cache starts over past _PATHS_KEPT)
        self._segment_dirs: dict[int, Path] = {}
        self._dispatch_logs: dict[int, Path] = {}
        self._check_format(create)

    def _check_format(self, create: bool) -> None:
        marker = self.root / MARKER_NAME
        if marker.exists():
            info = read_marker(marker)
            if info["format"] not in READABLE_FORMATS:
                raise StorageError(f"{self.root} holds format {info['format']}, this build reads formats "
                                   f"{sorted(READABLE_FORMATS)}: open it with the build that wrote it")
            if info["segment_minutes"] != self.segment_minutes:
                raise StorageError(
                    f"{self.root} was written with segment_minutes={info['segment_minutes']}, "
                    f"not {self.segment_minutes}; open it with the same value")
            if info["format"] != FORMAT_VERSION and create:
                self._write_marker(marker)  # this build is about to write what older formats cannot read
            return
        if not create:
            raise StorageError(f"{self.root} is not a timewheel data directory (no timewheel.json)")
        for d in (self.schedule_dir, self.ingest_dir, self.meta_dir):
            d.mkdir(parents=True, exist_ok=True)
        self._write_marker(marker)

    def _write_marker(self, marker: Path) -> None:
        """Write timewheel.json for this build's format, atomically and durably."""
        tmp = marker.with_suffix(".tmp")
        with open(tmp, "w") as f:
            f.write(json.dumps({"format": FORMAT_VERSION, "segment_minutes": self.segment_minutes}) + "\n")
            f.flush()
            # its bytes before its name: renamed first, a power loss can leave the name on an empty file
            os.fsync(f.fileno())
        os.replace(tmp, marker)
        fsync_path(self.root)

    @classmethod
    def open_existing(cls, data_dir: str | os.PathLike[str]) -> "SegmentLayout":
        """Open a data directory with the segment length it was written with."""
        marker = Path(data_dir) / MARKER_NAME
        if not marker.exists():
            raise StorageError(f"{data_dir} is not a timewheel data directory (no {MARKER_NAME})")
        return cls(data_dir, read_marker(marker)["segment_minutes"], create=False)

    def segment_start(self, due_ms: int) -> int:
        """Start (epoch ms) of the segment holding a message due at `due_ms`."""
        return due_ms - due_ms % self.segment_ms

    def segment_starts(self, due_ms: np.ndarray) -> np.ndarray:
        """Vectorised `segment_start`."""
        return due_ms - due_ms % self.segment_ms

    def segment_dir(self, start_ms: int) -> Path:
        """Directory of the segment starting at `start_ms`."""
        path = self._segment_dirs.get(start_ms)
        if path is None:
            if len(self._segment_dirs) >= _PATHS_KEPT:
                self._segment_dirs.clear()
            path = self._segment_dirs[start_ms] = self.schedule_dir / segment_name(start_ms)
        return path

    def part_log(self, start_ms: int, part: int) -> Path:
        """Record file of a part."""
        return self.segment_dir(start_ms) / (part_name(part) + PART_LOG_SUFFIX)

    def part_index(self, start_ms: int, part: int) -> Path:
        """Index sidecar of a part."""
        return self.segment_dir(start_ms) / (part_name(part) + PART_INDEX_SUFFIX)

    def part_origin(self, start_ms: int, part: int) -> Path:
        """Origin sidecar of a part: where each record came from (`storage.origin`)."""
        return self.segment_dir(start_ms) / (part_name(part) + ORIGIN_SUFFIX)

    def dispatch_log(self, start_ms: int) -> Path:
        """Dispatch log of a segment."""
        path = self._dispatch_logs.get(start_ms)
        if path is None:
            if len(self._dispatch_logs) >= _PATHS_KEPT:
                self._dispatch_logs.clear()
            path = self._dispatch_logs[start_ms] = self.segment_dir(start_ms) / DISPATCH_LOG_NAME
        return path

    def list_segments(self, since_ms: int | None = None, until_ms: int | None = None) -> list[int]:
        """Starts of the segment directories on disk, oldest first; with bounds, only the segments
        whose hour overlaps [since_ms, until_ms)."""
        if not self.schedule_dir.exists():
            return []
        starts = (parse_segment_name(e.name) for e in os.scandir(self.schedule_dir) if e.is_dir())
        return sorted(s for s in starts if s is not None
                      and (since_ms is None or s + self.segment_ms > since_ms)
                      and (until_ms is None or s < until_ms))

    def list_parts(self, start_ms: int) -> list[int]:
        """Part numbers of a segment that have a record file, in order."""
        d = self.segment_dir(start_ms)
        if not d.exists():
            return []
        parts = []
        for e in os.scandir(d):
            stem, _, suffix = e.name.partition(".")
            if "." + suffix == PART_LOG_SUFFIX and stem.isdigit() and len(stem) == 5:
                parts.append(int(stem))
        return sorted(parts)

    def claim_part(self, start_ms: int) -> int:
        """Create a new, empty part in a segment (its record file and both sidecars) and return its
        number; safe against other writers (`_part_numbers`)."""
        d = self.segment_dir(start_ms)
        d.mkdir(parents=True, exist_ok=True)
        with _part_numbers(d):
            existing = self.list_parts(start_ms)
            part = existing[-1] + 1 if existing else 0
            while part <= MAX_PART:
                try:
                    fd = os.open(self.part_log(start_ms, part), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
                except FileExistsError:
                    part += 1
                    continue
                os.close(fd)
                for sidecar in (self.part_index(start_ms, part), self.part_origin(start_ms, part)):
                    # one left by a publish cut short (its index linked, its log not) is a link to a
                    # staged file: unlinked, never written through
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(sidecar)
                    os.close(os.open(sidecar, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
                return part
        raise StorageError(f"segment {segment_name(start_ms)} has no free part number left (max {MAX_PART})")

    def publish_part(self, start_ms: int, staged_log: Path, staged_index: Path) -> int:
        """Move a finished part (staged elsewhere on the same filesystem) into a segment atomically,
        and durably: the segment directory, then `schedule/`, are fsynced once both names are in it."""
        d = self.segment_dir(start_ms)
        d.mkdir(parents=True, exist_ok=True)
        with _part_numbers(d):
            existing = self.list_parts(start_ms)
            part = existing[-1] + 1 if existing else 0
            while part <= MAX_PART:
                try:
                    # the index goes first: a .log without .idx would be taken for a torn live part
                    os.link(staged_index, self.part_index(start_ms, part))
                except FileExistsError:
                    part += 1
                    continue
                try:
                    os.link(staged_log, self.part_log(start_ms, part))
                except FileExistsError:
                    os.unlink(self.part_index(start_ms, part))
                    part += 1
                    continue
                # the links are directory entries, and the segment directory is one in schedule/ (made
                # here, or by the engine since its last checkpoint): without these fsyncs a power loss
                # can drop a part whose staged copy is already gone below
                fsync_path(d)
                fsync_path(self.schedule_dir)
                os.unlink(staged_log)
                os.unlink(staged_index)
                return part
        raise StorageError(f"segment {segment_name(start_ms)} has no free part number left (max {MAX_PART})")


@contextlib.contextmanager
def _part_numbers(segment_dir: Path) -> Iterator[None]:
    """Held while a writer takes a part number in a segment: the engine rolling to a new live part
    (`claim_part`), a backfill publishing a sealed one (`publish_part`, another process). Without
    it the engine could create its index while a publish had linked its own index at that number
    and not yet its log: the engine's writes would then go into the staged index's file, and the
    publish, finding the log's name taken, would unlink the engine's index and publish its own,
    now holding the engine's entries, at the next number.

    Retention moves a done segment's directory out under it too (`moving_out`). A writer that
    waited for the lock while the directory was moved finds another (or none) at its path: it locks
    the directory there, made again, so that nothing it writes goes out with the retired segment."""
    while True:
        try:
            fd = os.open(segment_dir, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:  # moved out between the caller's mkdir and this open
            fd = -1
        if fd >= 0:
            try:
                lock_exclusive(fd, segment_dir, "a backfill publishing into a segment the engine is writing")
                if _names(fd, segment_dir):
                    yield
                    return
            finally:
                os.close(fd)  # lets the lock go
        log.info("%s was moved out while a writer waited to take a part number there: made again", segment_dir)
        segment_dir.mkdir(parents=True, exist_ok=True)
        fsync_path(segment_dir.parent)


@contextlib.contextmanager
def moving_out(segment_dir: Path) -> Iterator[None]:
    """Held while retention checks a segment unchanged and moves its directory out: no part number
    is taken there in between (`_part_numbers`; a publish waiting for it then writes into a new
    directory at the path)."""
    fd = os.open(segment_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        lock_exclusive(fd, segment_dir, "a backfill publishing into a segment the engine is writing")
        yield
    finally:
        os.close(fd)


def _names(fd: int, segment_dir: Path) -> bool:
    """Whether `segment_dir` still names the directory open as `fd` (not moved out meanwhile)."""
    held = os.fstat(fd)
    try:
        there = os.stat(segment_dir)
    except FileNotFoundError:
        return False
    return (there.st_dev, there.st_ino) == (held.st_dev, held.st_ino)


