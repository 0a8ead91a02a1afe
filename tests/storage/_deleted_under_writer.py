"""A live part's file deleted by hand under the store's writer, at each moment its descriptors can be in."""
from __future__ import annotations

from pathlib import Path

from storage import Record, ScheduleStore
from storage import _writer

#: the file deleted while the writer holds it open; then the part closed; or deleted while it is closed
MOMENTS = ["while-open", "while-open-then-closed", "while-closed"]
_HOUR = 3_600_000


def delete_under_writer(store: ScheduleStore, path: Path, when: str, t0: int) -> None:
    """Delete `path` `when` (one of MOMENTS). The writer closes a part's files once it wrote more parts
    since than it keeps open, and opens them again at the part's next write: one record in each of that
    many other hours closes it."""
    if when == "while-open":
        path.unlink()
        return
    if when == "while-open-then-closed":
        path.unlink()
    others = [Record(f"other-{h}", "T", b"o", t0 + (h + 1) * _HOUR) for h in range(_writer._MAX_OPEN_FDS)]
    store.append(others, t0, [("b:1", h) for h in range(len(others))])
    if when == "while-closed":
        path.unlink()
