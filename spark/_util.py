"""Small helpers shared by the sources and jobs: option parsing and time arguments."""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Mapping


def int_option(options: Mapping[str, str], name: str) -> int | None:
    """An integer option of a data source, None when absent or empty."""
    value = options.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError as e:
        raise ValueError(f"option {name}={value!r} is not an integer") from e


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
