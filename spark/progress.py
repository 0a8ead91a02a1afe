"""A rich progress bar over the Spark stages running while a block of code runs."""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

from pyspark.sql import SparkSession


@contextmanager
def stage_progress(spark: SparkSession, description: str, *, enabled: bool = True) -> Iterator[None]:
    """Show tasks done / tasks of the active stages on stderr (nothing when stderr is not a
    terminal or `enabled` is false) until the block exits."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    if not enabled or not console.is_terminal:
        yield
        return
    tracker = spark.sparkContext.statusTracker()
    stop = threading.Event()
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("tasks"), TimeElapsedColumn(), console=console, transient=True) as progress:
        task = progress.add_task(description, total=None)

        def poll() -> None:
            """Update the bar from the status tracker every half second."""
            while not stop.wait(0.5):
                infos = [i for i in (tracker.getStageInfo(s) for s in tracker.getActiveStageIds()) if i]
                if infos:
                    name = infos[-1].name.split(" at ")[0]
                    progress.update(task, total=sum(i.numTasks for i in infos),
                                    completed=sum(i.numCompletedTasks for i in infos),
                                    description=f"{description}: {name}")

        t = threading.Thread(target=poll, name="timewheel-progress", daemon=True)
        t.start()
        try:
            yield
        finally:
            stop.set()
            t.join()
