"""Worker threads whose death is logged as such (the engine reports dead threads; the service exits)."""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable


def guarded(run: Callable[[], None], log: logging.Logger, failures: dict[str, str]) -> Callable[[], None]:
    """`run`, with an error that escapes it logged as the death of its thread instead of re-raised, and
    kept in `failures` under the thread's name (what /readyz says of it)."""
    def body() -> None:
        try:
            run()
        except Exception as e:
            failures[threading.current_thread().name] = f"{type(e).__name__}: {e}"
            log.critical("thread %s died: the engine reports it, and a service stops for its supervisor to "
                         "restart it", threading.current_thread().name, exc_info=True)
    return body
