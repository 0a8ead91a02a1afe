"""Making and opening a data directory from the command line, with errors that say what to run.

`timewheel init` makes one with the engine's defaults (or the segment length given); the commands
that read or write files offline (inspect, find, backfill, audit, replay, export) open one through
`open_data_dir`, whose errors name the command that fixes them. `data_dir_option` parses their
--data-dir.
"""
from __future__ import annotations

import errno
import os
from pathlib import Path

from storage import SegmentLayout, StorageError
from timewheel.config import EngineConfig
from timewheel.errors import TimewheelError

#: the engine's default segment length, which `init` uses unless told otherwise
DEFAULT_SEGMENT_MINUTES: int = EngineConfig.__dataclass_fields__["segment_minutes"].default  # type: ignore[assignment]


class DataDirError(TimewheelError):
    """A path is not (and cannot become) a data directory; the message says what to run."""


def data_dir_option(text: str) -> Path:
    """Parse a --data-dir option; an empty one (an unset variable) is refused in one line, exit 2, as
    `serve` refuses it, where a Path would take it for the working directory."""
    from timewheel.app._cli_errors import fail

    if not text.strip():
        fail(f"--data-dir {text!r} is invalid: it must name a directory (for example --data-dir var/data)")
    return Path(text)


def _init_hint(path: Path) -> str:
    return (f"make one with `timewheel init --data-dir {path}` (segments of {DEFAULT_SEGMENT_MINUTES} minutes, "
            "the engine's default), or point --data-dir at the engine's data directory")


def _unusable(path: Path, e: OSError) -> str:
    """What an OSError looking at `path` itself says (a name the filesystem refuses, a directory
    this user may not read): the path is cut, as a name too long would fill the screen."""
    shown = str(path) if len(str(path)) <= 200 else f"{str(path)[:100]}...{str(path)[-40:]}"
    return (f"cannot use {shown} as a data directory: {e.strerror or e}; point --data-dir at the engine's data "
            "directory (a path this filesystem takes, readable by this user)")


def open_data_dir(path: Path) -> SegmentLayout:
    """Open an existing data directory with the segment length it was written with."""
    try:
        return _open_data_dir(path)
    except OSError as e:
        raise DataDirError(_unusable(path, e)) from e


def _open_data_dir(path: Path) -> SegmentLayout:
    # Path.exists() answers False only for a missing path: ENAMETOOLONG or EACCES are raised
    if not path.exists():
        raise DataDirError(f"{path} does not exist: {_init_hint(path)}")
    if not path.is_dir():
        raise DataDirError(f"{path} is a file, not a data directory: point --data-dir at a directory")
    if not (path / "timewheel.json").exists():
        raise DataDirError(f"{path} is not a timewheel data directory (no timewheel.json): {_init_hint(path)}")
    try:
        return SegmentLayout.open_existing(path)
    except StorageError as e:
        raise DataDirError(f"{path} cannot be opened: {e}") from e


def init_data_dir(path: Path, segment_minutes: int | None = None) -> tuple[SegmentLayout, bool]:
    """Make a data directory (or open the one there); returns it and whether it was made now.

    `segment_minutes` None: the engine's default for a new one, whatever an existing one has.
    Refuses a directory that already holds other files, so a mistyped path never gets mixed in.
    """
    try:
        return _init_data_dir(path, segment_minutes)
    except OSError as e:
        raise DataDirError(_unusable(path, e)) from e


def _init_data_dir(path: Path, segment_minutes: int | None) -> tuple[SegmentLayout, bool]:
    if (path / "timewheel.json").exists():
        try:
            if segment_minutes is None:
                return SegmentLayout.open_existing(path), False
            return SegmentLayout(path, segment_minutes, create=False), False
        except StorageError as e:
            raise DataDirError(f"{path} is already a data directory, made differently: {e}") from e
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise DataDirError(f"{path} exists and is not an empty directory: give a new or empty one to init")
    try:
        minutes = DEFAULT_SEGMENT_MINUTES if segment_minutes is None else segment_minutes  # 0 is refused, not the default
        return SegmentLayout(path, minutes, create=True), True
    except (StorageError, OSError) as e:
        raise DataDirError(f"cannot make a data directory in {path}: {e}") from e


def require_directories(layout: SegmentLayout) -> None:
    """Raise NotADirectoryError naming the first of the data directory's own directories (schedule/,
    ingest/, meta/) that is there as something else, which a reader would take for an empty one."""
    for d in (layout.schedule_dir, layout.ingest_dir, layout.meta_dir):
        if os.path.lexists(d) and not d.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(d))


def read_error(data_dir: Path, e: OSError) -> str:
    """What an OSError reading the files of a data directory says: the path that failed and what to
    check (a file of mode 000, a directory where a file belongs, a failing disk)."""
    where = f"{e.filename} in the data directory {data_dir}" if e.filename else f"the data directory {data_dir}"
    return (f"cannot read {where}: {e.strerror or e}; check that path (its owner and mode, whether it is "
            "a file or a directory as the engine wrote it, the disk), then run the command again")


def os_error_at_start(e: OSError, data_dir: Path | str) -> str:
    """What an OSError at the engine's start says: of the data directory only when it names a path
    there (full disk, too many open files or a refused socket are not the directory's)."""
    root = os.path.abspath(data_dir)
    named = e.filename is not None and os.path.abspath(str(e.filename)).startswith(root + os.sep)
    return f"cannot open the data directory {data_dir}: {e}" if named else f"the engine could not start: {e}"
