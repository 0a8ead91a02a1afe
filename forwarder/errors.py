"""Typed errors of the forwarder: callers branch on the class or on `retriable`, never on messages."""

from __future__ import annotations

from typing import ClassVar

__all__ = [
    "ForwarderError",
    "LocalRocketMQError",
    "NativeClientError",
    "NativeLayoutError",
    "SendError",
]


class ForwarderError(Exception):
    """Base class of every error raised by the forwarder package."""

    #: True when repeating the same call later may succeed (broker down, timeout, busy).
    retriable: ClassVar[bool] = False


class LocalRocketMQError(ForwarderError):
    """The local RocketMQ (tests, demo, bench) could not be downloaded, started or stopped."""


class NativeClientError(ForwarderError):
    """A call into the bundled RocketMQ client library (librocketmq) failed."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        #: the library's status code (CStatus), when the failure came with one
        self.status = status


class SendError(NativeClientError):
    """A message (or batch) could not be sent; the broker may be down, busy or unreachable."""

    # The client reports every kind of send failure the same way ("No route info of this
    # topic", "send request failed", "wait response timeout"), so a send is always worth
    # retrying; a message that can never be sent must be caught before it reaches the client.
    retriable: ClassVar[bool] = True


class NativeLayoutError(NativeClientError):
    """The bundled client library does not look like the build these bindings were written for."""
