"""Housekeeping: the store's checkpoints and retention, on a thread of their own.

Both take the store's locks for a while (an fsync, deleting old segments): off the timer and the
dispatch threads, they never hold up a release or a send. A checkpoint also fsyncs the tombstone
log, in every durability mode. A checkpoint that fails is kept as `failure` until one succeeds:
the service reports itself not ready meanwhile (the loss window of `flush = "async"` is bounded
by one checkpoint only while checkpoints succeed). One that can never succeed in this process (RocksDB
stopped the meta store's writes: `MetaStoreStoppedError`) ends the thread instead of retrying.

A segment retention retired can come back: a backfill that planned before the retirement publishes
its part into the segment made again (`storage.layout`). Nothing else would send that part before
the next start (the timer's rescans look at loaded and done segments), so each checkpoint looks
for the segments it retired in the listing and hands those back to `on_reappeared` (the timer's
catch-up).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from storage import MetaStoreStoppedError, ScheduleStore
from timewheel.cancels import Tombstones
from timewheel.clock import Clock
from timewheel.config import EngineConfig
from timewheel.failure_log import RepeatedFailureLog
from timewheel._threads import guarded

log = logging.getLogger("timewheel.housekeeping")


class Housekeeper:
    """Checkpoints the store every `checkpoint_seconds` and retires segments past `retention_hours`."""

    def __init__(self, config: EngineConfig, store: ScheduleStore, clock: Clock,
                 tombstones: Tombstones | None = None,
                 on_reappeared: Callable[[list[int]], None] | None = None) -> None:
        """Housekeeping of `store` (and of `tombstones`' log, fsynced at each checkpoint);
        `on_reappeared` is handed the retired segments found on disk again (oldest first)."""
        self.config = config
        self.store = store
        self.clock = clock
        self.tombstones = tombstones
        self.on_reappeared = on_reappeared
        #: segments retired since the start (one an hour at most): looked for at each checkpoint
        self.retired: set[int] = set()
        #: why the last checkpoint failed, None once one succeeds
        self.failure: str | None = None
        # a disk that stays full fails every checkpoint: its traceback once, then once a minute
        self._checkpoint_failures = RepeatedFailureLog(log, level=logging.ERROR)
        #: thread name -> the error that ended it
        self.failures: dict[str, str] = {}
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the housekeeping thread."""
        self._stopping.clear()
        self._thread = threading.Thread(target=guarded(self._run, log, self.failures),
                                        name="timewheel-housekeeping", daemon=True)
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
            self.run_once()

    def run_once(self) -> None:
        """One checkpoint (the store, then the tombstone log) and retirement; a failure is kept in `failure`."""
        try:
            self.store.checkpoint()
            if self.tombstones is not None:
                self.tombstones.flush()
            if self.config.retention_hours > 0:
                self.retired.update(self.store.retire(self.clock.now_ms(), int(self.config.retention_hours * 3_600_000)))
            self._look_for_reappeared()
        except MetaStoreStoppedError as e:
            # no checkpoint can succeed before the store is reopened: a retry every checkpoint_seconds would
            # have no end, so the thread ends (`guarded`: /readyz names it, `serve` exits 3 for a restart)
            self.failure = f"{type(e).__name__}: {e}"
            raise
        except Exception as e:
            self.failure = f"{type(e).__name__}: {e}"
            self._checkpoint_failures.failed(e, "checkpoint failed; retrying in %ss", self.config.checkpoint_seconds)
            return
        self.failure = None
        run = self._checkpoint_failures.end()
        if run is not None:
            log.info("checkpoints succeed again after %d failed over %.0f s", *run)

    def _look_for_reappeared(self) -> None:
        """Hand the retired segments whose directory is back (a part published into them) to
        `on_reappeared`; one listing of the schedule directory, only once something was retired."""
        if not self.retired or self.on_reappeared is None:
            return
        back = sorted(self.retired.intersection(self.store.layout.list_segments()))
        if not back:
            return
        log.warning("%d retired segment(s) came back with new records (a backfill published into them): sent "
                    "as a catch-up: %s", len(back), back)
        self.on_reappeared(back)
        self.retired.difference_update(back)
