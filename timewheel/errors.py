"""Typed errors of the engine: each says what was wrong and what to do."""
from __future__ import annotations

from storage.errors import DelayTooLongError, StorageError


class TimewheelError(Exception):
    """Base class of the engine's errors."""


class InvalidMessageError(TimewheelError, ValueError):
    """A message that breaks the contract: no topic, bad due time, body too large, ..."""

    def __init__(self, reason: str, *, index: int | None = None) -> None:
        super().__init__(reason if index is None else f"message #{index}: {reason}")
        self.reason = reason
        self.index = index


class EngineStateError(TimewheelError, RuntimeError):
    """The engine was used in a state that does not allow it (not started, stopped)."""


class ConfigError(TimewheelError, ValueError):
    """A configuration key is unknown or its value invalid; the message names the key."""


class NotSendingNowError(TimewheelError):
    """A send refused because this engine may not send now (a replica's lease fence is closed): the
    message is kept for another attempt; nothing failed that anyone has to act on."""


__all__ = ["ConfigError", "DelayTooLongError", "EngineStateError", "InvalidMessageError", "NotSendingNowError",
           "StorageError", "TimewheelError"]
