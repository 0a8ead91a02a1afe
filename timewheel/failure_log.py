"""How a failure that repeats many times a second goes to the log without burying everything else.

A batch pulled again after its store failed, a lease round ZooKeeper refused: each is retried at
once, so a failure that lasts (a full disk, an ACL changed under the shard) fails every second or
faster until something ends it. A traceback each time would fill the log with one story. A run of
failures logs its first with the traceback, then again only when the error says something else or
`REPEAT_S` went by since the line last logged, with how many failed and over how long; the caller
tells the run's end once, from `end()`. Two errors that differ only in their numbers (a batch's
size, an offset, how long a request waited) say the same: a value in the message would otherwise
make every failure new.
"""
from __future__ import annotations

import logging
import re
import threading
import time
from typing import Callable

__all__ = ["REPEAT_S", "RepeatedFailureLog", "one_line"]

#: a run's failure that says the same as the line last logged is logged again after this long
REPEAT_S = 60.0
#: what two failures may differ in and still say the same: a count, an offset, a port, a timeout
_NUMBER = re.compile(r"\d+")


def one_line(error: BaseException) -> str:
    """`Type: message` on one line (an error without a message: its type alone)."""
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


class RepeatedFailureLog:
    """The log lines of one kind of failure that may repeat many times a second; safe across threads."""

    def __init__(self, log: logging.Logger, monotonic: Callable[[], float] = time.monotonic,
                 repeat_s: float = REPEAT_S, level: int = logging.WARNING) -> None:
        """Lines go to `log` at `level`; `monotonic` is the clock a run's span and `repeat_s` are read on."""
        self._log, self._monotonic, self._repeat_s, self._level = log, monotonic, repeat_s, level
        self._lock = threading.Lock()
        self._since: float | None = None  # the run's first failure, None while none fails
        self._count = 0
        self._logged: tuple[str, float] | None = None  # the run's error last logged, and when

    def failed(self, error: BaseException, message: str, *args: object, note: str | None = None) -> bool:
        """Count a failure; log `message % args`, the run's note and `error`'s traceback (at the level) if it is
        the run's first, says something else than the line last logged (its numbers aside), or that was
        `repeat_s` ago (True).

        The note is " (N in a row over S s)" from the second failure on; `note` replaces it (a caller that
        counts its failures otherwise)."""
        text = _NUMBER.sub("#", one_line(error))
        with self._lock:
            now = self._monotonic()
            if self._since is None:
                self._since, self._count = now, 0
            self._count += 1
            logged = self._logged
            if logged is not None and logged[0] == text and now - logged[1] < self._repeat_s:
                return False
            self._logged = (text, now)
            count, since = self._count, self._since
        if note is None:
            note = "" if count == 1 else f" ({count} in a row over {now - since:.0f} s)"
        self._log.log(self._level, message + "%s", *args, note, exc_info=error)
        return True

    def end(self) -> tuple[int, float] | None:
        """End the run of failures: (how many, over how many seconds), or None if none was failing."""
        if self._since is None:  # each stored batch asks: no lock while nothing fails
            return None
        with self._lock:
            since, count = self._since, self._count
            self._since, self._count, self._logged = None, 0, None
        return None if since is None else (count, self._monotonic() - since)

    def logged_within(self) -> bool:
        """Whether this run's failure was logged less than `repeat_s` ago (its count told lately)."""
        with self._lock:
            logged = self._logged
        return logged is not None and self._monotonic() - logged[1] < self._repeat_s
