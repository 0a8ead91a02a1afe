"""The demo as a person sees it: run in a real terminal (tmux), read back with capture-pane.

The live view must update in place: at any moment the screen holds exactly one table, at the size
the terminal started with and after it is widened mid-run, and no log line tears through it. tmux is a hard requirement of this test
(apt-get install -y tmux), not a reason to skip it.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
TITLE = "timewheel demo:"
TOP_LEFT, BOTTOM_LEFT = "┏┌╭", "┗└╰"


def tables_on(screen: str) -> int:
    """Tables on a screen: lines opening with a table's top-left corner (a torn redraw repeats it)."""
    return sum(1 for line in screen.splitlines() if line.strip() and line.lstrip()[0] in TOP_LEFT)


class Tmux:
    """A private tmux server (its own socket), so nobody else's sessions are touched."""

    def __init__(self, tmp: Path) -> None:
        tmux = shutil.which("tmux")
        assert tmux, "this test needs tmux: apt-get install -y tmux"
        self.base = [tmux, "-L", f"tw-test-{uuid.uuid4().hex[:8]}", "-f", str(tmp / "tmux.conf")]
        (tmp / "tmux.conf").write_text("set -g status off\n")  # the whole window is the pane

    def __call__(self, *args: str) -> str:
        return subprocess.run([*self.base, *args], check=True, capture_output=True, text=True).stdout

    def close(self) -> None:
        subprocess.run([*self.base, "kill-server"], capture_output=True)


#: the terminal's size when the demo starts, then after a person widens it mid-run
SIZES = ((80, 24), (160, 50))


def test_the_live_view_is_one_table_updated_in_place_at_each_size_and_across_a_resize(tmp_path: Path) -> None:
    tmux = Tmux(tmp_path)
    pythonpath = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    # COLUMNS/LINES from the test runner would override the terminal's real size
    cmd = (f"cd {tmp_path} && env -u COLUMNS -u LINES PYTHONPATH={pythonpath} TERM=xterm-256color {sys.executable} -m "
           f"timewheel.app.cli demo --duration 12 --rate 50; echo __EXIT=$?__; sleep 600")
    screens: list[str] = []
    live: dict[tuple[int, int], list[str]] = {size: [] for size in SIZES}
    try:
        (width, height), (wider, taller) = SIZES
        tmux("new-session", "-d", "-s", "demo", "-x", str(width), "-y", str(height), cmd)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            pane_w, pane_h = tmux("display-message", "-p", "-t", "demo", "#{pane_width} #{pane_height}").split()
            size = (int(pane_w), int(pane_h))
            screen = tmux("capture-pane", "-p", "-t", "demo")
            screens.append(screen)
            if "__EXIT=" in screen:
                break
            if TITLE in screen and f"{TITLE} done" not in screen:
                assert size in live, f"the pane is {size}, not one of {SIZES}"
                live[size].append(screen)
                if size == SIZES[0] and len(live[size]) >= 6:  # seen long enough: widen it, as a person might
                    tmux("resize-window", "-t", "demo", "-x", str(wider), "-y", str(taller))
            time.sleep(0.5)
        final = screens[-1]
        for (w, h), seen in live.items():
            print(f"--- the screen at {w}x{h}, while it runs ---\n{seen[len(seen) // 2] if seen else ''}")
        print(f"--- the screen at the end ---\n{final}")
        assert "__EXIT=0__" in final, f"the demo did not end well:\n{final}"
        for size, seen in live.items():
            assert len(seen) >= 5, f"the live view was seen {len(seen)} times at {size}: too few to judge it"
            for s in seen:
                assert tables_on(s) == 1 and s.count(TITLE) == 1, f"the live view at {size} is not one table:\n{s}"
        assert tables_on(final) == 1 and final.count(TITLE) == 1, final
        assert sum(1 for line in final.splitlines() if line.strip() and line.lstrip()[0] in BOTTOM_LEFT) == 1, final
        assert f"{TITLE} done" in final and "every message accounted for" in final, final
        assert "WARNING" not in final and "Traceback" not in final, f"log lines reached the terminal:\n{final}"
    finally:
        tmux.close()
        # the demo keeps its directory (it names its log file there): this test's run goes
        for work in {w for screen in screens for w in re.findall(r"log lines go to (\S+)/demo\.log", screen)}:
            shutil.rmtree(work, ignore_errors=True)
