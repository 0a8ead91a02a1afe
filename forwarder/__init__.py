"""Everything RocketMQ: the wire client, ingest consumer, delivery sink, traffic shaping, local broker.

Importing `forwarder` loads no native library: the engine speaks RocketMQ through `forwarder.rocketmq`.
The bundled client (`NativeProducer`, `NativePushConsumer`, `read_message`, `LogLevel`) is for a user's
own Python producer or consumer; its names are loaded from `forwarder._rmq_native` on first use.
"""
from typing import Any

from forwarder.config import RocketMQConfig
from forwarder.contract import ContractLimits, ContractViolation, to_message, to_outgoing
from forwarder.control import CANCEL_ID, CANCEL_KEY, CancelNotSentError, cancel_message, send_cancel
from forwarder.delivery import CircuitBreaker, RocketMQSink
from forwarder.endpoints import RocketMQEndpoints, connect_rocketmq
from forwarder.errors import ForwarderError, LocalRocketMQError, NativeClientError, NativeLayoutError, SendError
from forwarder.ingest import DelayTopicIngest
from forwarder.local_rocketmq import LocalRocketMQ, ensure_distribution, run_foreground
from forwarder.trace import TraceWriter, TracingSink, traced_schedule
from forwarder.rocketmq import (SYSTEM_PROPERTIES, OutgoingMessage, ReceivedMessage, RemotingError, RemotingProducer,
                                RemotingPullConsumer, SendResult, SendStatus, topic_route, user_properties)

_NATIVE = frozenset({"LogLevel", "NativeProducer", "NativePushConsumer", "read_message"})

__all__ = ["CANCEL_ID", "CANCEL_KEY", "CancelNotSentError", "CircuitBreaker", "ContractLimits", "ContractViolation",
           "DelayTopicIngest", "ForwarderError", "LocalRocketMQ", "LocalRocketMQError", "LogLevel",
           "NativeClientError", "NativeLayoutError", "NativeProducer", "NativePushConsumer", "OutgoingMessage",
           "ReceivedMessage", "RemotingError", "RemotingProducer", "RemotingPullConsumer", "RocketMQConfig",
           "RocketMQEndpoints", "RocketMQSink", "SYSTEM_PROPERTIES", "SendError", "SendResult", "SendStatus",
           "TraceWriter", "TracingSink", "cancel_message", "connect_rocketmq", "ensure_distribution", "read_message", "run_foreground",
           "send_cancel", "to_message", "to_outgoing", "topic_route", "traced_schedule", "user_properties"]


def __getattr__(name: str) -> Any:
    """The bundled client's names, importing (and so loading librocketmq.so) only when one is asked for."""
    if name in _NATIVE:
        from forwarder import _rmq_native

        return getattr(_rmq_native, name)
    raise AttributeError(f"module 'forwarder' has no attribute {name!r}")
