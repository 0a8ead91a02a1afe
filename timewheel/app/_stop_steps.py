"""A stop of several steps that runs every one: a step that fails must not leave the later ones (the
store, the ports, the connections) open; the first failure is raised at the end, the others logged."""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator

__all__ = ["StopSteps"]

log = logging.getLogger("timewheel.app.service")


class StopSteps:
    """Runs each `with steps("what"):` block, keeping the first error; `raise_first()` raises it."""

    def __init__(self) -> None:
        """No step has failed yet."""
        self.first: BaseException | None = None
        self.failed: list[str] = []

    @contextmanager
    def __call__(self, what: str) -> Iterator[None]:
        """One step of the stop; its error (an Exception) is kept or logged, and the stop goes on."""
        try:
            yield
        except Exception as e:
            self.failed.append(what)
            if self.first is None:
                self.first = e
                log.error("stopping %s failed (the stop goes on; this error is raised at its end): %s: %s", what,
                          type(e).__name__, e)
            else:
                log.error("stopping %s failed too (the first error is the one raised)", what, exc_info=True)

    def raise_first(self) -> None:
        """Raise the first step's error, if one failed."""
        if self.first is not None:
            raise self.first
