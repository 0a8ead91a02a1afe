"""Who hears of each commit's new records (the timer, to put them in its wheel), and the first of
them that failed.

The records are stored by the time a listener hears of them: a listener's error raised as the
commit's would have the caller retry, find every id stored and hand nothing on. So the error is
kept instead (`failure`), for the engine to stop on; the next start loads the records from disk.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

log = logging.getLogger("timewheel.storage")


class CommitListeners:
    """The store's commit listeners (called under its write lock, in commit order) and the first failure."""

    def __init__(self) -> None:
        #: each is called with a commit's new records (LOCATION_DTYPE); it must be quick and must
        #: not call back into the store's writers
        self.listeners: list[Callable[[np.ndarray], None]] = []
        #: why a listener failed since the store was opened (what it missed is stored, not handed on)
        self.failure: str | None = None

    def tell(self, written: np.ndarray) -> None:
        """Hand a commit's new records to every listener; a failure is logged and kept, not raised."""
        for listener in self.listeners:
            try:
                listener(written)
            except Exception as e:
                log.critical("a commit listener failed on %d stored records", len(written), exc_info=True)
                self.failure = self.failure or (
                    f"{len(written)} stored records were not handed on by a commit listener ({type(e).__name__}: {e})")
