"""Control messages on the delay topic: cancels that every engine reading the topic sees.

A message on the delay topic that carries one of these properties and no TW_TARGET_TOPIC is a
control message, never scheduled:
    TW_CANCEL_ID    cancel the message with this id: the id its producer got back (UNIQ_KEY), or
                    the TW_ORIGINAL_MSG_ID a delivered copy carries (`<UNIQ_KEY>:<checksum>`)
    TW_CANCEL_KEY   cancel every message carrying this key: those stored, and those that arrive while
                    the cancel is kept (`engine.tombstone_retention_hours`)
A cancel may come before the message it names (another queue, another replica's pace): the engine
keeps it as a tombstone and cancels the message when it arrives. A control message that is not
well-formed goes to the dead-letter topic with the reason, like any message that breaks the contract.

`send_cancel` puts one copy on every queue of the delay topic, so that every engine (each replica
of each shard) reads it whatever queues it owns; copies are idempotent.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from forwarder.contract import TARGET_TOPIC, ContractViolation
from forwarder.errors import ForwarderError
from forwarder.rocketmq import OutgoingMessage, ReceivedMessage, RemotingError, RemotingProducer
from timewheel.cancels import CancelRequest

CANCEL_ID = "TW_CANCEL_ID"
CANCEL_KEY = "TW_CANCEL_KEY"
CONTROL_PROPERTIES = frozenset({CANCEL_ID, CANCEL_KEY})
#: the tag control messages sent by the engine carry (consumers of the delay topic can filter them)
CONTROL_TAG = "TW_CONTROL"


class CancelNotSentError(ForwarderError):
    """A cancel did not reach every queue of the delay topic; sending it again is safe (idempotent)."""


def split_control(batch: Sequence[ReceivedMessage]) -> tuple[list[ReceivedMessage], list[ReceivedMessage]]:
    """(delay messages, control messages) of a pulled batch, each in arrival order."""
    control = [m for m in batch if not CONTROL_PROPERTIES.isdisjoint(m.properties)]
    if not control:
        return list(batch), []
    return [m for m in batch if CONTROL_PROPERTIES.isdisjoint(m.properties)], control


def to_cancel(msg: ReceivedMessage, now_ms: int) -> CancelRequest:
    """The cancel a control message asks for; ContractViolation (the dead letter's reason) if it is not one."""
    props = msg.properties
    if TARGET_TOPIC in props:
        raise ContractViolation(f"a message with {CANCEL_ID} or {CANCEL_KEY} is a cancel and carries no "
                                f"{TARGET_TOPIC}: send the cancel as a message of its own")
    named = [(name, props[name]) for name in (CANCEL_ID, CANCEL_KEY) if name in props]
    if len(named) != 1:
        raise ContractViolation(f"a cancel carries exactly one of {CANCEL_ID} or {CANCEL_KEY}, not both")
    name, value = named[0]
    born = msg.born_timestamp if msg.born_timestamp > 0 else now_ms
    try:  # the rule the admin API and the Python API apply too (`CancelRequest`)
        return CancelRequest(value, None, born) if name == CANCEL_ID else CancelRequest(None, value, born)
    except ValueError as e:
        raise ContractViolation(f"{name}: {e}") from e


def cancel_message(delay_topic: str, msg_id: str | None = None, key: str | None = None) -> OutgoingMessage:
    """The control message cancelling `msg_id` or every message under `key` (its body, which RocketMQ
    requires and the engine ignores, says what it cancels, for whoever reads the topic)."""
    req = CancelRequest(msg_id, key, 0)  # the same rule as the receiving side: what it names, as it names it
    name, text = (CANCEL_ID, req.msg_id) if req.msg_id is not None else (CANCEL_KEY, req.key)
    assert text is not None
    return OutgoingMessage(delay_topic, f"{name}={text}".encode(), CONTROL_TAG, None, {name: text})


@dataclass(frozen=True, slots=True)
class CancelSent:
    """Where a cancel went: how many queues of the delay topic hold a copy."""

    queues: int


def send_cancel(producer: RemotingProducer, delay_topic: str, msg_id: str | None = None,
                key: str | None = None) -> CancelSent:
    """Put a cancel on every queue of the delay topic; CancelNotSentError unless every queue took it."""
    try:
        results = producer.send_to_every_queue(cancel_message(delay_topic, msg_id, key))
    except RemotingError as e:
        raise CancelNotSentError(f"the cancel could not be sent to {delay_topic}: {e}; send it again") from e
    failed = [r for r in results if isinstance(r, RemotingError)]
    if failed:
        raise CancelNotSentError(f"the cancel reached {len(results) - len(failed)} of {len(results)} queues of "
                                 f"{delay_topic} ({failed[0]}); send it again (copies are harmless)")
    return CancelSent(len(results))
