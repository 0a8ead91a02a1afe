"""RocketMQ's remoting protocol spoken directly: the engine's one RocketMQ client; loads no native library.

Modules, each with one job:
    message     plain message types, the property codec, property names
    protocol    request and response codes; the one encoder and decoder of remoting frames
    codec       messages inside bodies: the batch a producer sends, what a pull returns, message ids
    connection  one TCP connection, requests pipelined and matched by opaque
    namesrv     NameServer look-ups: topic routes
    producer    batch sends to any topics (delivery, dead letters, replay)
    _routes     the producer's topic routes: cached, refreshed, kept through NameServer outages
    _send_batch the producer's SEND_BATCH_MESSAGE requests in the making: cut within limits, headers
    consumer    a clustering pull consumer (ingest), composed of the three below; answers what brokers ask it
    _membership heartbeats, the group's members, the split of the queues among them
    _puller     the pull threads: pull requests, their answers, batches to the callback, commits, retries
    _queue_state the one owner of each consumed queue's offsets, pull in flight, and what was accepted
    consumer_status  the bodies of those questions and answers (reset offsets, running info for mqadmin)
    lookup      which messages a topic already holds, by UNIQ_KEY, through the brokers' message index
    admin       topic creation, group members, broker registration, a group's lag (launcher, tests)
    compression message bodies in every codec producers write, read back under a size bound
    acl         the AccessKey/SecretKey request signature of RocketMQ's ACL
    security    ACL credentials and TLS, applied by every connection
"""
from forwarder.rocketmq.acl import Credentials
from forwarder.rocketmq.admin import QueueLag, broker_config, broker_registered, consumer_ids, consumer_lag, create_topics, queue_lags
from forwarder.rocketmq.codec import BROKER_MAX_MESSAGE_BYTES, decode_messages, encode_message
from forwarder.rocketmq.connection import Connection
from forwarder.rocketmq.consumer import BatchCallback, Queue, RemotingPullConsumer, allocate_averagely
from forwarder.rocketmq.errors import (BatchesRefusedError, BrokerBusyError, BrokerError, BrokerUnavailableError, ConnectionFailedError, FencedError,
                                       MessageDecodeError, MessageRejectedError, ProtocolError, RemotingError,
                                       RequestTimeoutError, TopicNotFoundError)
from forwarder.rocketmq.lookup import Copy, KeyLookup, LookupState, MessageLookup, query_broker
from forwarder.rocketmq.message import (KEYS, NAME_VALUE_SEPARATOR, PROPERTY_SEPARATOR, SYSTEM_PROPERTIES, TAGS,
                                        UNIQ_KEY, WAIT, OutgoingMessage, Receipt, ReceivedMessage, SendResult,
                                        SendStatus, join_properties, split_properties, user_properties)
from forwarder.rocketmq.namesrv import NameServerClient, TopicRoute, topic_route
from forwarder.rocketmq.producer import RemotingProducer
from forwarder.rocketmq._send_batch import EncodedBatches, SendBatch
from forwarder.rocketmq.protocol import Response, error_for_code
from forwarder.rocketmq.security import ClientSecurity

__all__ = [
    "BROKER_MAX_MESSAGE_BYTES", "BatchCallback", "BatchesRefusedError", "BrokerBusyError", "BrokerError", "BrokerUnavailableError",
    "ClientSecurity", "Connection", "Copy", "Credentials", "EncodedBatches", "KeyLookup", "LookupState", "MessageLookup", "ConnectionFailedError", "KEYS", "MessageDecodeError", "MessageRejectedError",
    "NAME_VALUE_SEPARATOR", "NameServerClient", "OutgoingMessage", "PROPERTY_SEPARATOR", "ProtocolError", "Queue", "QueueLag",
    "Receipt", "ReceivedMessage", "RemotingError", "RemotingProducer", "RemotingPullConsumer", "RequestTimeoutError",
    "Response", "SYSTEM_PROPERTIES", "SendBatch", "SendResult", "SendStatus", "TAGS", "TopicNotFoundError", "TopicRoute", "UNIQ_KEY",
    "WAIT", "allocate_averagely", "broker_config", "broker_registered", "consumer_ids", "consumer_lag", "create_topics", "decode_messages",
    "encode_message", "error_for_code", "join_properties", "query_broker", "queue_lags", "split_properties", "topic_route", "user_properties",
]
