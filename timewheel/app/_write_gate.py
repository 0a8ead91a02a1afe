"""Admin-API requests that use the engine (cancels, traffic rules, look-ups) against a service that may
be stopping: many run at once, none starts once the stop has begun, and the stop waits for those
under way before it closes what they use (the engine's store and meta store, the producer that puts
a cancel on the delay topic)."""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import Iterator

from timewheel.errors import EngineStateError

log = logging.getLogger("timewheel.app.service")


class WriteGate:
    """Open until `close()`; `enter()` admits a write while open and raises EngineStateError after."""

    def __init__(self) -> None:
        """Open, no write under way."""
        self._cond = threading.Condition()
        self._open = True
        self._under_way = 0

    @contextlib.contextmanager
    def enter(self, refused: str) -> Iterator[None]:
        """Run the block as one write; EngineStateError(`refused`) if the gate is closed."""
        with self._cond:
            if not self._open:
                raise EngineStateError(refused)
            self._under_way += 1
        try:
            yield
        finally:
            with self._cond:
                self._under_way -= 1
                self._cond.notify_all()

    def close(self, timeout: float) -> None:
        """Admit no more writes, then wait up to `timeout` seconds for those under way."""
        with self._cond:
            self._open = False
            if not self._cond.wait_for(lambda: self._under_way == 0, timeout):
                log.warning("stopping with %d admin write(s) still under way after %.0f s", self._under_way, timeout)

    def reopen(self) -> None:
        """Admit writes again (a service started again)."""
        with self._cond:
            self._open = True
