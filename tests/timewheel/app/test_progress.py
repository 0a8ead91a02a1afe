"""The segment progress bar: drawn on a terminal, absent from pipes (so `--json` stays JSON)."""
from __future__ import annotations

import io

from rich.console import Console

from timewheel.app.progress import segment_progress


def test_a_terminal_sees_segments_done_of_all_and_the_bar_goes_away() -> None:
    out = io.StringIO()
    with segment_progress("checking every record", Console(file=out, force_terminal=True, width=100)) as tell:
        for done in range(1, 5):
            tell(done, 4)
    drawn = out.getvalue()
    assert "checking every record" in drawn and "4/4" in drawn and "segments" in drawn
    assert drawn.endswith("\x1b[2K")  # transient: the last thing drawn erases the bar


def test_a_pipe_sees_nothing() -> None:
    out = io.StringIO()
    with segment_progress("reading segments", Console(file=out, force_terminal=False)) as tell:
        tell(1, 1)
    assert out.getvalue() == ""
