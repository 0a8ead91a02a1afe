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
    """Put the cancel on every queue of the delay topic, then apply it to `engine`; how many it cancelled.

    Raises CancelNotSentError (nothing applied here) unless every queue took a copy.
    """
    from forwarder.control import CancelNotSentError as NotSent

    request = CancelRequest(msg_id, key, now_ms)  # refuses a malformed cancel before anything is sent
    try:
        endpoints.send_cancel(msg_id, key)
    except NotSent as e:
        raise CancelNotSentError(str(e)) from e
    return engine.apply_cancels([request])
