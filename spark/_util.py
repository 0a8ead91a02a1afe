"""Small helpers shared by the sources and jobs: option parsing, time arguments, one topic's records,
and the files of a data directory a job reads checked before it starts."""
from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

    from storage import SegmentLayout


def int_option(options: Mapping[str, str], name: str) -> int | None:
    """An integer option of a data source, None when absent or empty."""
    value = options.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError as e:
        raise ValueError(f"option {name}={value!r} is not an integer") from e


def of_topic(records: DataFrame, topic: str) -> DataFrame:
    """Records of `topic`, and those that fail their checks (crc_ok false): their topic cannot be read,
    so whichever it was they are kept, for the job to count and report rather than drop unseen."""
    from pyspark.sql import functions as F

    return records.where((F.col("topic") == topic) | ~F.col("crc_ok"))


def parse_time_ms(value: str | int) -> int:
    """UTC epoch ms of an argument given as epoch ms or ISO-8601 (naive means UTC), from 1970 to the
    end of year 9999 (what a time can be shown as: a report printed after the job must not fail)."""
    if isinstance(value, int):
        return _in_range(value, value)
    text = value.strip()
    if text.lstrip("-").isdigit():
        return _in_range(int(text), value)
    try:
        dt = datetime.fromisoformat(text.replace("Z", "+00:00") if text.endswith(("Z", "z")) else text)
    except ValueError as e:
        raise ValueError(f"{value!r} is neither epoch milliseconds nor an ISO-8601 time "
                         "(e.g. 2027-01-15T08:00:00Z)") from e
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return _in_range(int(dt.timestamp() * 1000), value)


#: the last millisecond of year 9999, the latest time `datetime` (and so every report) can show
LATEST_MS = 253_402_300_799_999


def _in_range(ms: int, value: str | int) -> int:
    """`ms`, or a ValueError saying it is before 1970 or past year 9999."""
    if ms < 0:
        raise ValueError(f"{value!r} is before 1970-01-01T00:00:00Z: give a time since then")
    if ms > LATEST_MS:
        raise ValueError(f"{value!r} is past 9999-12-31T23:59:59.999Z: give epoch milliseconds (13 digits today) "
                         "or an ISO-8601 time")
    return ms


def iso_ms(ms: int) -> str:
    """ISO-8601 UTC text of epoch ms, with milliseconds."""
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


class UnreadableDataError(OSError):
    """A file of the data directory a job reads cannot be read; `filename` names it, `strerror` says why."""

    def __str__(self) -> str:
        """What cannot be read, why, and what to check."""
        return (f"cannot read {self.filename}: {self.strerror}; check that path (its owner and mode, whether it "
                "is a file or a directory as the engine wrote it, the disk), then run the job again")


def require_readable(layout: SegmentLayout, since_ms: int | None = None, until_ms: int | None = None, *,
                     dispatch: bool = True, logs: bool = True) -> None:
    """Raise `UnreadableDataError` for the first file a job reads, of the segments overlapping
    [since_ms, until_ms), that cannot be read: the schedule and segment directories, each part's
    index and (with `logs`) log, and (with `dispatch`) each dispatch log.

    A task that meets such a file fails the job with a Python worker's traceback, after the job
    may have written part of its output; `timewheel inspect` names the same files.
    """
    try:
        for seg in layout.list_segments(since_ms, until_ms):
            for path in _segment_files(layout, seg, dispatch, logs):
                _open_to_read(path)
    except OSError as e:
        raise UnreadableDataError(e.errno, e.strerror, str(e.filename or layout.schedule_dir)) from e


def _segment_files(layout: SegmentLayout, seg: int, dispatch: bool, logs: bool) -> list[Path]:
    """The files of a segment a job reads: its parts' indexes, their logs with `logs`, its dispatch
    log with `dispatch`."""
    try:
        parts = layout.list_parts(seg)
    except FileNotFoundError:
        return []  # retention moved the segment away after it was listed: its records were done
    files = [f for p in parts for f in ((layout.part_log(seg, p), layout.part_index(seg, p)) if logs
                                        else (layout.part_index(seg, p),))]
    return (files + [layout.dispatch_log(seg)]) if dispatch else files


def _open_to_read(path: Path) -> None:
    """Open `path` for reading and close it; a missing file passes."""
    try:
        with open(path, "rb"):
            pass
    except FileNotFoundError:
        pass  # the readers take a missing index or dispatch log as empty, and a part retired meanwhile as done
