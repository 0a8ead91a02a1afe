"""Fencing by time: the deadline after which a lease holder stops sending, on the monotonic clock.

RocketMQ brokers check no token on send, so a holder fences itself. ZooKeeper expires a session
no earlier than `session_timeout` after the last request it received from the client; a request
that succeeded was received after it was sent. So when a request sent at monotonic time `t`
succeeds, the session (and the lease node it owns) lives at least until `t + session_timeout` on
the server's clock, and the holder may send until `t + fraction * session_timeout` on its own.
The rest of the session (`1 - fraction`) is the margin for the two clocks' rates and for the one
batch already on the wire. A standby takes over only when the server has expired the session, so
the two never send at once while the clocks' rates differ by less than that margin.

A pause (SIGSTOP, a VM freeze, a long GC) does not stop the monotonic clock: a holder resuming
after its deadline finds it passed before its next send, whatever ZooKeeper says later.
"""
from __future__ import annotations

import math
import threading
import time
from typing import Callable

__all__ = ["FencingDeadline"]


class FencingDeadline:
    """When the lease holder must stop sending; extended by confirmed contact, cut by revocation."""

    def __init__(self, session_timeout_s: float, fraction: float,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.session_timeout_s = session_timeout_s
        self.fraction = fraction
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._deadline = -math.inf
        self._revoked_at = -math.inf

    def confirmed(self, sent_at: float) -> None:
        """A request sent at monotonic `sent_at` succeeded while holding the lease: extend the deadline.

        A request sent before the last revocation extends nothing (its answer may be older than
        the loss of the connection that revoked it).
        """
        with self._lock:
            if sent_at < self._revoked_at:
                return
            self._deadline = max(self._deadline, sent_at + self.fraction * self.session_timeout_s)

    def revoke(self) -> None:
        """Stop sending now (the connection is suspended, the session lost, the lease given up)."""
        with self._lock:
            self._revoked_at = self._monotonic()
            self._deadline = -math.inf

    def set_session_timeout(self, seconds: float) -> None:
        """The timeout the server granted (never more than asked: deadlines only shrink)."""
        with self._lock:
            self.session_timeout_s = min(self.session_timeout_s, seconds)

    def may_send(self) -> bool:
        """True until the deadline."""
        return self._monotonic() < self._deadline

    def remaining_s(self) -> float:
        """Seconds left before the deadline (negative or -inf once past)."""
        return self._deadline - self._monotonic()
