"""The demo's view when its output is not a terminal: one plain line per update."""
from __future__ import annotations

import io

from rich.console import Console

from timewheel.app.demo import DemoState, _View

NOW = 1_795_460_400_000  # 2026-11-23 19:00 UTC


class _Stats:
    def stats(self) -> dict[str, object]:
        return {"wheel_entries": 12, "retrying": 1, "loaded_segments": {str(NOW): 12}}


def test_output_that_is_not_a_terminal_gets_one_plain_line_per_update() -> None:
    out = io.StringIO()
    console = Console(file=out, width=80)
    assert not console.is_terminal
    state = DemoState(sent=40)
    with _View(console, state, _Stats()) as view:  # type: ignore[arg-type]
        assert view.live is None
        view.update("producing (1/30 s)")
        view.update("producing (1/30 s)")  # within the same second: no second line
        view.update("done", final=True)
    lines = out.getvalue().splitlines()
    assert lines == [
        "timewheel demo: producing (1/30 s): sent 40, delivered 0, cancelled 0, dead-lettered 0, in the wheel 12, "
        "retrying 1, lateness p50 0.0 ms, lateness p99 0.0 ms, lateness max 0.0 ms, pending 2026-11-23 19:00Z 12",
        "timewheel demo: done: sent 40, delivered 0, cancelled 0, dead-lettered 0, in the wheel 12, "
        "retrying 1, lateness p50 0.0 ms, lateness p99 0.0 ms, lateness max 0.0 ms, pending 2026-11-23 19:00Z 12",
    ]
