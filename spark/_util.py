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
    """UTC epoch ms of an argument given as epoch ms or ISO-8601 (naive means UTC)."""
    if isinstance(value, int):
        return value
    text = value.strip()
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        dt = datetime.fromisoformat(text.replace("Z", "+00:00") if text.endswith(("Z", "z")) else text)
    except ValueError as e:
        raise ValueError(f"{value!r} is neither epoch milliseconds nor an ISO-8601 time "
                         "(e.g. 2027-01-15T08:00:00Z)") from e
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return int(dt.timestamp() * 1000)


def iso_ms(ms: int) -> str:
    """ISO-8601 UTC text of epoch ms, with milliseconds."""
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")
