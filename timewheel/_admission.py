"""What the engine admits: its checks of a message, and messages encoded as the store writes them.

The engine's own limits (its configuration) apply to every way in: `Engine.schedule` checks each
`Message` here; `Engine.schedule_encoded` checks rows already encoded (ingest's one pass, which
applied the producer contract) on their columns, all rows at once, with the same reasons.
"""
from __future__ import annotations

import uuid
from typing import Sequence

import numpy as np

from storage import EncodedRecords, InvalidRecordError, Origin, encode
from timewheel.config import EngineConfig
from timewheel.errors import InvalidMessageError
from timewheel.message import Message


def validate(m: Message, i: int, now: int, config: EngineConfig) -> None:
    """Raise InvalidMessageError (with `i`, its position) unless the engine can take `m` now."""
    if not isinstance(m, Message):
        raise InvalidMessageError(f"expected a timewheel.Message, got {type(m).__name__}", index=i)
    if not m.topic or not isinstance(m.topic, str):
        raise InvalidMessageError("a message needs a target topic", index=i)
    if not isinstance(m.deliver_at_ms, int) or isinstance(m.deliver_at_ms, bool) or m.deliver_at_ms < 0:
        raise InvalidMessageError(f"deliver_at_ms must be a non-negative int of epoch ms, not "
                                  f"{m.deliver_at_ms!r}", index=i)
    if m.deliver_at_ms - now > config.max_delay_ms:
        raise InvalidMessageError(_too_late(m.deliver_at_ms - now, config), index=i)
    if not isinstance(m.body, (bytes, bytearray)):
        raise InvalidMessageError(f"body must be bytes, not {type(m.body).__name__}", index=i)
    if len(m.body) > config.max_body_bytes:
        raise InvalidMessageError(_too_large(len(m.body), config), index=i)


def _too_late(delay: int, config: EngineConfig) -> str:
    return f"due in {delay} ms, past the maximum delay of {config.max_delay_ms} ms"


def _too_large(size: int, config: EngineConfig) -> str:
    return f"body of {size} bytes exceeds max_body_bytes={config.max_body_bytes}"


def encode_messages(messages: Sequence[Message], origins: Sequence[Origin] | None, now: int,
                    config: EngineConfig) -> tuple[EncodedRecords, list[InvalidMessageError | None]]:
    """The records `schedule` would store for `messages` (ids made where missing, accepted at
    `now`), as rows; per message, why the engine refuses it (then it has no row) or None."""
    rows = EncodedRecords()
    refusals: list[InvalidMessageError | None] = []
    for i, m in enumerate(messages):
        try:
            validate(m, i, now, config)
            mid = m.msg_id or uuid.uuid4().hex
            blob = encode(m.to_record(mid), now)
        except InvalidMessageError as e:
            refusals.append(InvalidMessageError(e.reason))
            continue
        except InvalidRecordError as e:  # as `schedule` reports what the store refuses
            refusals.append(InvalidMessageError(str(e)))
            continue
        origin = origins[i] if origins is not None else None
        rows.append_row(blob, mid, m.deliver_at_ms, len(m.body), tuple(m.keys),
                        origin[0] if origin is not None else None, origin[1] if origin is not None else 0)
        refusals.append(None)
    return rows, refusals


def check_rows(rows: EncodedRecords, now: int, config: EngineConfig) -> None:
    """Raise InvalidMessageError (with the first offender's position) unless every row is due
    within the engine's maximum delay and its body within its maximum size."""
    if not len(rows):
        return
    due = np.asarray(rows.due_ms, np.int64)
    size = np.asarray(rows.body_lengths, np.int64)
    bad = (due < 0) | (due - now > config.max_delay_ms) | (size > config.max_body_bytes)
    if not bad.any():
        return
    i = int(np.flatnonzero(bad)[0])
    d, s = int(due[i]), int(size[i])
    if d < 0:
        raise InvalidMessageError(f"deliver_at_ms must be a non-negative int of epoch ms, not {d!r}", index=i)
    if d - now > config.max_delay_ms:
        raise InvalidMessageError(_too_late(d - now, config), index=i)
    raise InvalidMessageError(_too_large(s, config), index=i)
