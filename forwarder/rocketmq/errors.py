"""Typed errors of the wire client: callers branch on the class or on `retriable`, never on messages.

`protocol.error_for_code` maps a broker's or NameServer's response code to one of these.
"""
from __future__ import annotations

from typing import Any, ClassVar

from forwarder.errors import ForwarderError

__all__ = [
    "BatchesRefusedError",
    "BrokerBusyError",
    "BrokerError",
    "BrokerUnavailableError",
    "ConnectionFailedError",
    "FencedError",
    "MessageDecodeError",
    "MessageRejectedError",
    "ProtocolError",
    "RemotingError",
    "RequestTimeoutError",
    "TopicNotFoundError",
]


class RemotingError(ForwarderError):
    """A request to the NameServer or a broker failed; `retriable` says whether trying later may help."""

    retriable: ClassVar[bool] = True

    def __init__(self, message: str, *, code: int | None = None, remark: str | None = None) -> None:
        super().__init__(message)
        #: the response code, when the server answered one
        self.code = code
        #: the server's explanation, when it gave one
        self.remark = remark


class ConnectionFailedError(RemotingError):
    """Could not connect, or the connection broke: the broker may be down or restarting."""


class FencedError(RemotingError):
    """Not sent: the sender's fence (a replica's lease deadline) had passed when the request was to be
    written. Nothing reached a broker; whoever holds the lease now sends it."""


class RequestTimeoutError(RemotingError):
    """No answer within the timeout; the request may or may not have been carried out."""


class ProtocolError(RemotingError):
    """The peer sent something that is not a remoting frame; the connection was dropped."""


class MessageDecodeError(ProtocolError):
    """A pull body that is not in the store format: what was read before the fault, and the rest raw."""

    def __init__(self, message: str, *, decoded: list[Any] | None = None, raw: bytes = b"") -> None:
        super().__init__(message)
        self.decoded = decoded or []
        self.raw = raw


class BrokerError(RemotingError):
    """The server answered with a response code that is not success (see `protocol.error_for_code`)."""

    retriable: ClassVar[bool] = False


class BrokerBusyError(BrokerError):
    """The broker sheds load (system busy, flow control, page cache busy): send again later."""

    retriable: ClassVar[bool] = True


class BrokerUnavailableError(BrokerError):
    """The broker cannot take writes now (system error, not writable, not the leader, store down)."""

    retriable: ClassVar[bool] = True


class TopicNotFoundError(BrokerError):
    """The topic does not exist (and the broker is not allowed to create it)."""


class MessageRejectedError(BrokerError):
    """The message or request is invalid (too large, bad properties, bad topic): resending cannot help."""


class BatchesRefusedError(ForwarderError):
    """The consumer's callback refused every batch of a broker's queues for longer than allowed, or
    raised this itself (a batch no retry can store): the pull thread stops (fail-stop), so its owner
    reports not ready instead of pulling the same messages again for ever. Nothing refused was
    committed: a restart reads it again."""
