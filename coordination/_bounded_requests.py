"""A kazoo handler whose blocking requests give up after a bound instead of waiting for a connection that may
never come back.

Kazoo queues a request made while its client reconnects until the connection is back, and its blocking
calls (`get`, `create`, `exists`, ...) wait for it with no timeout. A replica thread that makes one just
after the connection dropped (between its check that the client is connected and its request) would wait
for as long as ZooKeeper stays away: its rounds, and the failures they report, frozen. With this handler a
blocking call raises `KazooTimeoutError` past the bound instead, which the replica counts as a failed
round. The request itself may still run once the client reconnects, as one cut off by a dropped
connection may have run: the rounds allow for both (they look for their own node before creating one,
and write the watermark by compare-and-set).
"""
from __future__ import annotations

from typing import Any

from kazoo.handlers.threading import AsyncResult, SequentialThreadingHandler

__all__ = ["BoundedRequestsHandler"]


class _BoundedResult(AsyncResult):
    """An async result whose `get` without a timeout waits at most its handler's bound."""

    def __init__(self, handler: BoundedRequestsHandler) -> None:
        super().__init__(handler)
        self._bound_s = handler.bound_s

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """The result, waiting at most `timeout` or, when none is given, the handler's bound."""
        return super().get(block, self._bound_s if timeout is None else timeout)


class BoundedRequestsHandler(SequentialThreadingHandler):
    """Kazoo's threading handler, but a blocking request raises `KazooTimeoutError` after `bound_s` seconds."""

    def __init__(self, bound_s: float) -> None:
        super().__init__()
        self.bound_s = bound_s

    def async_result(self) -> AsyncResult:
        """A result whose blocking `get` is bounded."""
        return _BoundedResult(self)
