"""A cancel asked through the admin API or the CLI: sent as a control message to every queue of
the delay topic, so that every engine (each replica of each shard) applies it, and applied here at
once so that the answer can say what this engine cancelled."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from timewheel.cancels import CancelRequest
from timewheel.engine import Engine
from timewheel.errors import TimewheelError

if TYPE_CHECKING:
    from forwarder import RocketMQEndpoints


#: where a cancel asked here was applied: an engine alone, a replica holding its shard's lease, a standby
APPLIED_ON = ("engine", "holder", "standby")

_STANDBY_NOTE = ("applied on this standby replica, which does not send; the lease holder applies it when it reads the "
                 "copy put on the delay topic (normally within a pull), and may still deliver a message due before "
                 "then. For a promise, send the cancel to the holder's admin API (see `timewheel status`), or as a "
                 "control message on the delay topic (TW_CANCEL_ID / TW_CANCEL_KEY) well before the message is due.")


@dataclass(frozen=True)
class CancelAnswer:
    """What an admin-API cancel did: how many this engine cancelled, where, and whether that is a promise
    that no replica will deliver them (True on an engine alone or the lease holder; False on a standby)."""

    cancelled: int
    applied_on: str = "engine"

    @property
    def promise(self) -> bool:
        """Whether the engine that sends this shard's messages has the cancel already."""
        return self.applied_on != "standby"

    def to_dict(self) -> dict[str, object]:
        """The JSON answer."""
        doc: dict[str, object] = {"cancelled": self.cancelled, "applied_on": self.applied_on, "promise": self.promise}
        if not self.promise:
            doc["note"] = _STANDBY_NOTE
        return doc


class CancelNotSentError(TimewheelError):
    """The cancel did not reach every queue of the delay topic; asking again is safe (idempotent)."""


def cancel_everywhere(engine: Engine, endpoints: "RocketMQEndpoints", msg_id: str | None, key: str | None,
                      now_ms: int) -> int:
    """Apply the cancel to `engine`, then put it on every queue of the delay topic; how many this
    engine cancelled.

    Applied here first, so that the count is this engine's whoever's copy comes back first (the
    copies it then reads are repeats). Raises CancelNotSentError unless every queue took a copy:
    the cancel holds here already, and asking again is safe.
    """
    from forwarder.control import CancelNotSentError as NotSent

    cancelled = engine.apply_cancels([CancelRequest(msg_id, key, now_ms)])
    try:
        endpoints.send_cancel(msg_id, key)
    except NotSent as e:
        raise CancelNotSentError(str(e)) from e
    return cancelled
