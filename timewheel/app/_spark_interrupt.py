"""Ctrl-C (SIGINT) while a Spark command runs: the command stops, says what was left undone, exits 130.

PySpark's own SIGINT handler cannot be left to do this: it calls into the JVM from inside the signal
handler, on the connection the interrupted call is still waiting on, so the cancel is queued behind
the very job it should stop (which runs to its end) and the two calls can read each other's answers.
Before its session is up, a KeyboardInterrupt in PySpark's start leaves the half-started driver JVM
running for good. So the command starts the session off the main thread (PySpark then installs no
handler of its own), and its handler here only records the signal and hands the stop to a thread
with its own connection: the jobs cancelled and the session stopped once it is up, the driver JVM
terminated while it starts or on a second Ctrl-C. Whatever the interrupted calls then raise or
return, the command ends with `timewheel: interrupted: ...` and exit code 130, never as done.
"""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING, Callable, Iterator, TypeVar

from timewheel.app._cli_errors import fail

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

#: the exit code of a command stopped by SIGINT, as a shell reports one (128 + 2)
INTERRUPTED_EXIT = 130

T = TypeVar("T")


class SparkInterrupts:
    """Records Ctrl-C while a Spark command runs, and stops its session from a thread of its own."""

    def __init__(self) -> None:
        """Nothing interrupted yet, no session started yet."""
        self.interrupted = threading.Event()
        self._session: SparkSession | None = None
        self._signals = 0
        self._lock = threading.Lock()
        self._stoppers: list[threading.Thread] = []

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        """The SIGINT handler: never raises into the interrupted call, only starts the stop."""
        self.interrupted.set()
        self._signals += 1
        gentle = self._signals == 1
        t = threading.Thread(target=self._stop, args=(gentle,), name="timewheel-interrupt", daemon=True)
        self._stoppers.append(t)
        t.start()

    def started(self, session: SparkSession) -> None:
        """The session is up: a Ctrl-C from now on cancels its jobs and stops it (one before now stops it here)."""
        with self._lock:
            self._session = session
        if self.interrupted.is_set():
            self._stop(gentle=True)

    def _stop(self, gentle: bool) -> None:
        """Cancel the jobs and stop the session when it is up and `gentle`; else terminate the driver JVM."""
        from spark.session import stop_driver_jvm

        with self._lock:
            session = self._session
        if gentle and session is not None:
            try:
                session.sparkContext.cancelAllJobs()
                session.stop()
                return
            except Exception:  # noqa: BLE001 - the JVM may be gone or stopping already: terminate it below
                pass
        stop_driver_jvm()

    def wait_stopped(self) -> None:
        """Wait for the stops started so far (a second Ctrl-C terminates a stop that hangs)."""
        for t in list(self._stoppers):
            t.join()


def start_off_main_thread(start: Callable[[], T]) -> T:
    """`start()` run on a thread of its own, its result or its exception here; the main thread keeps
    taking signals meanwhile (PySpark installs its SIGINT handler only when started on the main thread)."""
    box: dict[str, object] = {}

    def run() -> None:
        """Start, keeping what came out."""
        try:
            box["value"] = start()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread below
            box["error"] = e

    t = threading.Thread(target=run, name="timewheel-spark-start", daemon=True)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


@contextmanager
def interruptible(undone: str) -> Iterator[SparkInterrupts]:
    """Run a Spark command's session under `SparkInterrupts`; once interrupted, whatever the block
    raised or returned, print `timewheel: interrupted: {undone}` and exit 130."""
    interrupts = SparkInterrupts()
    on_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, interrupts.on_signal) if on_main else None
    try:
        try:
            yield interrupts
        except BaseException:
            if not interrupts.interrupted.is_set():
                raise
        if interrupts.interrupted.is_set():
            interrupts.wait_stopped()
            fail(f"interrupted: {undone}", INTERRUPTED_EXIT)
    finally:
        if on_main:
            signal.signal(signal.SIGINT, previous)
