"""Everything RocketMQ: local broker, ingest consumer, delivery sink, traffic shaping."""
from forwarder._rmq_native import (SYSTEM_PROPERTIES, LogLevel, NativeProducer, NativePushConsumer, OutgoingMessage,
                                   ReceivedMessage, SendResult, read_message, user_properties)
from forwarder.contract import ContractLimits, ContractViolation, to_message, to_outgoing
from forwarder.delivery import CircuitBreaker, RocketMQSink
from forwarder.endpoints import RocketMQEndpoints, connect_rocketmq
from forwarder.errors import ForwarderError, LocalRocketMQError, NativeClientError, NativeLayoutError, SendError
from forwarder.ingest import DelayTopicIngest
from forwarder.local_rocketmq import LocalRocketMQ, ensure_distribution, run_foreground, topic_route

__all__ = ["CircuitBreaker", "ContractLimits", "ContractViolation", "DelayTopicIngest", "ForwarderError",
           "LocalRocketMQ", "LocalRocketMQError", "LogLevel", "NativeClientError", "NativeLayoutError",
           "NativeProducer", "NativePushConsumer", "OutgoingMessage", "ReceivedMessage", "RocketMQEndpoints",
           "RocketMQSink", "SYSTEM_PROPERTIES", "SendError", "SendResult", "connect_rocketmq", "ensure_distribution",
           "read_message", "run_foreground", "to_message", "to_outgoing", "topic_route", "user_properties"]
