"""Fault injection for the fault harness: a sink that signals its own process right after a send
was written and answered, before the engine records its outcome.

That moment is the one a crash makes ambiguous (the target holds the copies; the dispatch log does
not say so), so a harness that kills the engine there gives every round something to resolve.
Configured by `rocketmq.fault_after_sends` and `rocketmq.fault_signal`; never set in production.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from storage import RecordBytes
from timewheel.message import Message

__all__ = ["SignalAfterSends"]

log = logging.getLogger("timewheel.faults")


class SignalAfterSends:
    """Wraps a record sink; after its `after`-th send batch that stored something, sends `signum`
    to this process (SIGKILL: it dies there; SIGSTOP: it freezes there until continued)."""

    def __init__(self, inner: Any, after: int, signum: signal.Signals,
                 kill: Callable[[int, int], None] = os.kill) -> None:
        """`after` >= 1 batches; `kill` is `os.kill` (a stand-in for tests)."""
        if after < 1:
            raise ValueError(f"after must be at least 1, not {after}")
        self.inner = inner
        self.after = after
        self.signum = signum
        self._kill = kill
        self._sent = 0
        self._lock = threading.Lock()
        self.max_in_flight = int(getattr(inner, "max_in_flight", 1))
        self.linger_ms = int(getattr(inner, "linger_ms", 0))
        self.linger_max_ms = int(getattr(inner, "linger_max_ms", self.linger_ms))

    def send_records(self, records: RecordBytes, extra: Mapping[str, str] | None = None,
                     fence: Callable[[], bool] | None = None) -> list[bool]:
        """Send through the inner sink, then signal if this was the chosen batch."""
        results = self.inner.send_records(records, extra, fence)
        self._after_send(any(results))
        return results

    def send_batch(self, messages: Sequence[Message]) -> list[bool]:
        """Send through the inner sink, then signal if this was the chosen batch."""
        results = self.inner.send_batch(messages)
        self._after_send(any(results))
        return results

    def dead_letter(self, messages: Sequence[Message], reason: str) -> None:
        """The inner sink's dead-letter path."""
        self.inner.dead_letter(messages, reason)

    def _after_send(self, stored: bool) -> None:
        if not stored:
            return
        with self._lock:
            self._sent += 1
            fire = self._sent == self.after
        if fire:
            log.warning("fault injection: %s to this process after %d send batches, before their outcomes are "
                        "recorded", self.signum.name, self.after)
            for h in logging.getLogger().handlers:
                h.flush()
            self._kill(os.getpid(), int(self.signum))
