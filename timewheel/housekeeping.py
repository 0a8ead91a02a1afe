"""Housekeeping: the store's checkpoints and retention, on a thread of their own.

Both take the store's locks for a while (an fsync, deleting old segments): off the timer and the
dispatch threads, they never hold up a release or a send.
"""
from __future__ import annotations

import logging
import threading
import time

from storage import ScheduleStore
from timewheel.clock import Clock
from timewheel.config import EngineConfig
from timewheel._threads import guarded

log = logging.getLogger("timewheel.housekeeping")


class Housekeeper:
    """Checkpoints the store every `checkpoint_seconds` and retires segments past `retention_hours`."""

    def __init__(self, config: EngineConfig, store: ScheduleStore, clock: Clock) -> None:
        self.config = config
        self.store = store
        self.clock = clock
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the housekeeping thread."""
        self._stopping.clear()
        self._thread = threading.Thread(target=guarded(self._run, log), name="timewheel-housekeeping", daemon=True)
        self._thread.start()

    def threads(self) -> list[threading.Thread]:
        """The housekeeping thread while started."""
        return [self._thread] if self._thread is not None else []

    def stop(self) -> None:
        """Stop the thread (a checkpoint in progress finishes)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        next_checkpoint = time.monotonic() + self.config.checkpoint_seconds
        while not self._stopping.is_set():
            self._stopping.wait(max(0.0, min(1.0, next_checkpoint - time.monotonic())))
            if self._stopping.is_set():
                return
            if time.monotonic() < next_checkpoint:
                continue
            next_checkpoint = time.monotonic() + self.config.checkpoint_seconds
            try:
                self.store.checkpoint()
                if self.config.retention_hours > 0:
                    self.store.retire(self.clock.now_ms(), int(self.config.retention_hours * 3_600_000))
            except Exception:
                log.exception("checkpoint failed; retrying in %ss", self.config.checkpoint_seconds)
