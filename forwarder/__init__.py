"""Everything RocketMQ: local broker, ingest consumer, delivery sink, traffic shaping."""
from forwarder.contract import ContractLimits, ContractViolation, to_message, to_outgoing
from forwarder.delivery import CircuitBreaker, RocketMQSink
from forwarder.endpoints import RocketMQEndpoints, connect_rocketmq
from forwarder.errors import ForwarderError, LocalRocketMQError, NativeClientError, SendError
from forwarder.ingest import DelayTopicIngest
from forwarder.local_rocketmq import LocalRocketMQ

__all__ = ["CircuitBreaker", "ContractLimits", "ContractViolation", "DelayTopicIngest", "ForwarderError",
           "LocalRocketMQ", "LocalRocketMQError", "NativeClientError", "RocketMQEndpoints", "RocketMQSink",
           "SendError", "connect_rocketmq", "to_message", "to_outgoing"]
