"""A cancel asked through the admin API or the CLI: sent as a control message to every queue of
the delay topic, so that every engine (each replica of each shard) applies it, and applied here at
once so that the answer can say what this engine cancelled."""
from __future__ import annotations

from typing import TYPE_CHECKING

from timewheel.cancels import CancelRequest
from timewheel.engine import Engine
from timewheel.errors import TimewheelError

if TYPE_CHECKING:
    from forwarder import RocketMQEndpoints


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
