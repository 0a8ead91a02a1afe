"""Times as people read them: UTC ISO-8601 with a space and a `Z` (`2026-11-23 19:00Z`).

Everything a person reads (inspect, audit, the demo, status) goes through here; `--json` output
keeps epoch milliseconds, which programs read. Trailing zero seconds and milliseconds are dropped,
so a segment start reads `2026-11-23 19:00Z` and a due time `2026-11-23 19:00:05.250Z`.
"""
from __future__ import annotations

from datetime import datetime, timezone


def human_time(ms: int | str) -> str:
    """UTC text of epoch milliseconds (an int, or digits as the stats JSON keys carry them)."""
    ms = int(ms)
    dt = datetime.fromtimestamp(ms // 1000, tz=timezone.utc)
    text = dt.strftime("%Y-%m-%d %H:%M")
    sub = ms % 1000
    if dt.second or sub:
        text += f":{dt.second:02d}" + (f".{sub:03d}" if sub else "")
    return text + "Z"

