"""A progress bar on stderr for commands that walk every segment of a data directory."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


@contextmanager
def segment_progress(description: str, console: Console | None = None) -> Iterator[Callable[[int, int], None]]:
    """A callback `(done, of)` drawing segments done on stderr while the block runs; nothing is
    drawn when stderr is not a terminal (so `--json` and pipes stay clean), and the bar is gone
    once the block exits."""
    console = console or Console(stderr=True)
    if not console.is_terminal:
        yield lambda done, of: None
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("segments"),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task(description, total=None)
        yield lambda done, of: bar.update(task, completed=done, total=of)
