"""Injected clocks: all time is UTC epoch milliseconds; tests drive a ManualClock."""
from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    """Anything that tells the time in UTC epoch milliseconds."""

    def now_ms(self) -> int:
        """Current UTC epoch milliseconds."""
        ...


class SystemClock:
    """The machine's wall clock, plus `offset_ms` (0 but in fault drills that skew one host's clock)."""

    def __init__(self, offset_ms: int = 0) -> None:
        self.offset_ms = offset_ms

    def now_ms(self) -> int:
        """Current UTC epoch milliseconds (offset included)."""
        return time.time_ns() // 1_000_000 + self.offset_ms


class ManualClock:
    """A clock that moves only when told to; thread-safe."""

    def __init__(self, start_ms: int = 0) -> None:
        self._now = start_ms
        self._lock = threading.Lock()

    def now_ms(self) -> int:
        """The time it was last set to."""
        with self._lock:
            return self._now

    def set(self, now_ms: int) -> None:
        """Move to `now_ms`; refuses to go back."""
        with self._lock:
            if now_ms < self._now:
                raise ValueError(f"a ManualClock does not go back ({now_ms} < {self._now})")
            self._now = now_ms

    def advance(self, ms: int) -> int:
        """Move forward by `ms`; returns the new time."""
        with self._lock:
            if ms < 0:
                raise ValueError("a ManualClock does not go back")
            self._now += ms
            return self._now


def seconds_until(clock: Clock, wake_ms: int | None, longest_s: float) -> float:
    """How long a thread should wait for `wake_ms` on `clock`: 0 if it has passed, at most
    `longest_s` (None: `longest_s`), so that work nobody woke the thread for waits that long at most."""
    if wake_ms is None:
        return longest_s
    if isinstance(clock, SystemClock):  # aim at the millisecond's first nanosecond
        return min(longest_s, max(0.0, ((wake_ms - clock.offset_ms) * 1_000_000 - time.time_ns()) / 1e9))
    return min(longest_s, max(0.0, (wake_ms - clock.now_ms()) / 1000))
