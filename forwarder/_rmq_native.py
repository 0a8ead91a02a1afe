"""The bundled RocketMQ client (rocketmq-client-python 0.5.0rc2) for a user's own Python producer or consumer.

The engine does not use it (it speaks the wire protocol through `forwarder.rocketmq`); it is what
`timewheel send`, the demo's producer and consumer, and tests that need an independent client use.
Its Python wrapper sends one message at a time and hands consumers NUL-terminated strings; this
module adds, over the bindings of `forwarder._rmq_library`:

- `NativeProducer`: sync send with binary bodies, and `SendAsync` with completion callbacks and
  a bound on messages in flight. `SendBatchMessage` is bound but private: against a Java broker
  this client's batches are stored as one single message (see `NativeProducer._send_batch`);
- `NativePushConsumer`: a push consumer with thread count, per-queue cache and batch size set,
  handing the callback a `ReceivedMessage` (binary-safe body, every property).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from ctypes import c_void_p
from types import TracebackType

from forwarder._rmq_library import (_CONSUME_SUCCESS, _OK, _ON_MESSAGE, _ON_SEND_EXCEPTION, _ON_SEND_SUCCESS,
                                    _RECONSUME_LATER, LIBRARY_PATH, LogLevel, _AddMessage, _build, _build_unchecked,
                                    _check, _CMQException, _CreateBatchMessage, _CreateProducer, _CreatePushConsumer,
                                    _CSendResult, _DestroyBatchMessage, _DestroyMessage, _DestroyPushConsumer,
                                    _last_error, _Model, _RegisterMessageCallback, _RegisterMessageCallbackOrderly,
                                    _result, _SendAsync, _SendBatchMessage, _SendMessageSync,
                                    _SetProducerCompressLevel, _SetProducerInstanceName, _SetProducerLogLevel,
                                    _SetProducerMaxMessageSize, _SetProducerNameServerAddress,
                                    _SetProducerSendMsgTimeout, _SetPushConsumerInstanceName,
                                    _SetPushConsumerLogLevel, _SetPushConsumerMaxCacheMessageSize,
                                    _SetPushConsumerMessageBatchMaxSize, _SetPushConsumerMessageModel,
                                    _SetPushConsumerNameServerAddress, _SetPushConsumerThreadCount, _ShutdownProducer,
                                    _ShutdownPushConsumer, _StartProducer, _StartPushConsumer, _Subscribe, _text,
                                    message_body, message_properties, read_message)
from forwarder.errors import NativeClientError, SendError
from forwarder.rocketmq.message import OutgoingMessage, ReceivedMessage, SendResult

__all__ = [
    "LIBRARY_PATH",
    "ConsumeCallback",
    "LogLevel",
    "NativeProducer",
    "NativePushConsumer",
    "SendCallback",
    "message_body",
    "message_properties",
    "read_message",
]

_log = logging.getLogger(__name__)

# -- producer -------------------------------------------------------------------------------------


#: a sync send the client refused with "No route info" within the send timeout is tried again this many
#: times (`NativeProducer.send` says why)
NO_ROUTE_RETRIES = 3
#: seconds before the first of those retries; each next one waits that much longer
NO_ROUTE_BACKOFF_S = 0.5
_NO_ROUTE = "No route info"

#: Called once per async send, from a library thread: (result, None) or (None, error).
SendCallback = Callable[[SendResult | None, SendError | None], None]


class NativeProducer:
    """A RocketMQ producer with sync, batch and async sends of binary messages."""

    def __init__(
        self,
        group: str,
        namesrv_addr: str,
        *,
        send_timeout_ms: int = 3000,
        max_message_size: int = 4 * 1024 * 1024,
        compress_level: int | None = None,
        instance_name: str | None = None,
        log_level: LogLevel | None = None,
        max_inflight: int = 2048,
    ) -> None:
        """Create (not start) a producer; `max_inflight` bounds async sends awaiting an answer."""
        handle = _CreateProducer(_text(group, "group"))
        if not handle:
            raise NativeClientError("CreateProducer returned NULL")
        self._handle: int | None = handle
        self._started = False
        self._send_timeout_s = send_timeout_ms / 1000
        _check(_SetProducerNameServerAddress(handle, _text(namesrv_addr, "namesrv_addr")), "set namesrv")
        _check(_SetProducerSendMsgTimeout(handle, send_timeout_ms), "set send timeout")
        # The client's own limit defaults to 128 KiB (the broker's is 4 MiB).
        _check(_SetProducerMaxMessageSize(handle, max_message_size), "set max message size")
        if compress_level is not None:
            _check(_SetProducerCompressLevel(handle, compress_level), "set compress level")
        if instance_name is not None:
            _check(_SetProducerInstanceName(handle, _text(instance_name, "instance_name")), "set instance")
        if log_level is not None:
            _check(_SetProducerLogLevel(handle, int(log_level)), "set log level")
        # Async bookkeeping: token -> callback. The token travels as the C call's userData.
        self._pending: dict[int, SendCallback] = {}
        self._pending_lock = threading.Lock()
        self._idle = threading.Condition(self._pending_lock)
        self._slots = threading.BoundedSemaphore(max_inflight)
        self._next_token = 1
        # The C function pointers must outlive every send that may still call them back.
        self._on_success = _ON_SEND_SUCCESS(self._async_success)
        self._on_exception = _ON_SEND_EXCEPTION(self._async_exception)

    # lifecycle

    def start(self) -> None:
        """Start the producer (connects lazily: the first send of a topic looks up its route)."""
        _check(_StartProducer(self._require()), "StartProducer")
        self._started = True

    def shutdown(self, timeout: float = 10.0) -> None:
        """Wait up to `timeout` for async sends in flight, then stop and free the producer."""
        if self._handle is None:
            return
        self.flush(timeout)
        handle, self._handle = self._handle, None
        # DestroyProducer is not called: in this build it deletes its wrapper struct through a
        # DefaultMQProducer pointer and crashes the process. A producer object is leaked instead.
        if self._started:
            _check(_ShutdownProducer(handle), "ShutdownProducer")

    def __enter__(self) -> NativeProducer:
        """Start and return self."""
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Shut down."""
        self.shutdown()

    def _require(self) -> int:
        """Return the native handle, or raise once shut down."""
        if self._handle is None:
            raise NativeClientError("the producer is shut down")
        return self._handle

    # sends

    def send(self, msg: OutgoingMessage) -> SendResult:
        """Send one message and wait for the broker's answer (retried by the client, up to 5 times).

        The client reports "No route info" when it found no route to the topic, and also when each of
        its own tries failed. An attempt that ended within the send timeout had no send time out (the
        one way the broker may have stored a message it did not answer): it is tried again
        `NO_ROUTE_RETRIES` times, `NO_ROUTE_BACKOFF_S` apart and more each time (a NameServer
        answering slowly under load makes the client give up on a route that exists). A longer one
        fails at once: trying it again could store the message twice.
        """
        return self._send_built(_build(msg), msg.topic)

    def send_unchecked(self, topic: str, body: bytes, properties: Mapping[bytes, bytes]) -> SendResult:
        """`send` with property bytes exactly as given, without `send`'s checks (text, RocketMQ's
        separator bytes): what a buggy or hostile producer can put on the wire, for testing what the
        engine does with it. SendError if the client or the broker refuses it."""
        return self._send_built(_build_unchecked(topic, body, properties), topic)

    def _send_built(self, cmsg: int, topic: str) -> SendResult:
        """Send a native message `send` built (refusals retried as it says), then destroy it."""
        try:
            handle = self._require()
            attempt = 0
            while True:
                result = _CSendResult()
                started = time.monotonic()
                status = _SendMessageSync(handle, cmsg, ctypes.byref(result))
                if status == _OK:
                    return _result(result)
                took = time.monotonic() - started
                detail = _last_error() or "no detail"
                attempt += 1
                if _NO_ROUTE not in detail or took >= self._send_timeout_s or attempt > NO_ROUTE_RETRIES:
                    tries = f" (tried {attempt} times)" if attempt > 1 else ""
                    raise SendError(f"send to {topic} failed{tries}: {detail} (the last try took {took:.1f} s)",
                                    status=status)
                _log.info("send to %s refused in %.1f s, before the send timeout (%s; try %d of %d): trying again",
                          topic, took, detail, attempt, NO_ROUTE_RETRIES + 1)
                time.sleep(NO_ROUTE_BACKOFF_S * attempt)
        finally:
            _DestroyMessage(cmsg)

    def _send_batch(self, msgs: Sequence[OutgoingMessage]) -> SendResult:
        """SendBatchMessage, kept only to measure and demonstrate it: do not use it to deliver.

        This client marks a batch with the header field batch="1", which a Java broker parses as
        false: the broker stores the whole encoded batch as ONE message (its body is the batch
        encoding, its own tags/keys/properties are lost). The result's msg_id is empty.
        """
        handle = self._require()
        if not msgs:
            raise ValueError("a batch needs at least one message")
        topic = msgs[0].topic
        if any(m.topic != topic for m in msgs):
            raise ValueError("all messages of a batch must have the same topic")
        batch = _CreateBatchMessage()
        if not batch:
            raise NativeClientError("CreateBatchMessage returned NULL")
        try:
            for msg in msgs:
                cmsg = _build(msg)
                try:
                    # AddMessage copies the message into the batch.
                    _check(_AddMessage(batch, cmsg), "AddMessage")
                finally:
                    _DestroyMessage(cmsg)
            result = _CSendResult()
            status = _SendBatchMessage(handle, batch, ctypes.byref(result))
            if status != _OK:
                # SendBatchMessage records no error text: the thread's last message is stale.
                raise SendError(f"batch send of {len(msgs)} messages to {topic} failed", status=status)
            return _result(result)
        finally:
            _DestroyBatchMessage(batch)

    def send_async(self, msg: OutgoingMessage, callback: SendCallback) -> None:
        """Send without waiting; `callback` runs once, on a library thread, with the outcome.

        Blocks while `max_inflight` sends await their answer. The client retries an async send
        only on the same broker, once; callbacks must be quick (they hold the client's I/O thread).
        """
        handle = self._require()
        cmsg = _build(msg)
        self._slots.acquire()
        with self._pending_lock:
            token = self._next_token
            self._next_token += 1
            self._pending[token] = callback
        try:
            status = _SendAsync(handle, cmsg, self._on_success, self._on_exception, c_void_p(token))
        except BaseException:
            self._complete(token, None, SendError(f"async send to {msg.topic} was interrupted"))
            raise
        finally:
            # The request is encoded and the client keeps its own copy of the message.
            _DestroyMessage(cmsg)
        if status != _OK:
            # The library may already have reported this failure through the exception callback;
            # _complete() runs a callback once only.
            detail = _last_error() or "no detail"
            self._complete(token, None, SendError(f"async send to {msg.topic} failed: {detail}", status=status))

    @property
    def inflight(self) -> int:
        """Async sends still waiting for their answer."""
        with self._pending_lock:
            return len(self._pending)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until no async send is in flight; False if `timeout` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._idle:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def _async_success(self, result: _CSendResult, _msg: int | None, token: int | None) -> None:
        """Library callback: an async send was stored."""
        self._complete(token or 0, _result(result), None)

    def _async_exception(self, exc: _CMQException, _msg: int | None, token: int | None) -> None:
        """Library callback: an async send failed."""
        detail = exc.msg.decode("utf-8", errors="replace") or "no detail"
        self._complete(token or 0, None, SendError(f"async send failed: {detail}", status=exc.error))

    def _complete(self, token: int, result: SendResult | None, error: SendError | None) -> None:
        """Run the callback of `token` once and free its slot."""
        with self._pending_lock:
            callback = self._pending.pop(token, None)
            if callback is None:
                return
            if not self._pending:
                self._idle.notify_all()
        self._slots.release()
        try:
            callback(result, error)
        except Exception:
            # An exception must not unwind into the library's thread.
            _log.exception("send callback failed")


# -- push consumer --------------------------------------------------------------------------------

#: Called for each message; True acknowledges it, False (or an exception) asks for redelivery.
ConsumeCallback = Callable[[ReceivedMessage], bool]


class NativePushConsumer:
    """A push consumer (clustering) whose callback receives complete `ReceivedMessage`s.

    The library hands a pulled batch (up to 32 messages per queue) to one consume thread, one
    message at a time; a failure sends that message and the rest of the batch back for retry
    (`%RETRY%<group>`), the ones already acknowledged stay done.
    """

    def __init__(
        self,
        group: str,
        namesrv_addr: str,
        on_message: ConsumeCallback,
        *,
        thread_count: int | None = None,
        max_cache_per_queue: int | None = None,
        batch_max_size: int | None = None,
        orderly: bool = False,
        broadcasting: bool = False,
        instance_name: str | None = None,
        log_level: LogLevel | None = None,
    ) -> None:
        """Create (not start) a consumer; subscribe() before start()."""
        handle = _CreatePushConsumer(_text(group, "group"))
        if not handle:
            raise NativeClientError("CreatePushConsumer returned NULL")
        self._handle: int | None = handle
        self._started = False
        self._on_message = on_message
        _check(_SetPushConsumerNameServerAddress(handle, _text(namesrv_addr, "namesrv_addr")), "set namesrv")
        model = _Model.BROADCASTING if broadcasting else _Model.CLUSTERING
        _check(_SetPushConsumerMessageModel(handle, int(model)), "set message model")
        if thread_count is not None:
            # Default: the number of CPUs. Each thread runs the Python callback under the GIL.
            _check(_SetPushConsumerThreadCount(handle, thread_count), "set thread count")
        if max_cache_per_queue is not None:
            # Default 1000 messages per queue before pulling pauses.
            _check(_SetPushConsumerMaxCacheMessageSize(handle, max_cache_per_queue), "set max cache")
        if batch_max_size is not None:
            # Honoured by the orderly consumer only: the concurrent one always hands over the
            # whole pulled batch, one message per callback.
            _check(_SetPushConsumerMessageBatchMaxSize(handle, batch_max_size), "set batch size")
        if instance_name is not None:
            _check(_SetPushConsumerInstanceName(handle, _text(instance_name, "instance_name")), "set instance")
        if log_level is not None:
            _check(_SetPushConsumerLogLevel(handle, int(log_level)), "set log level")
        self._callback = _ON_MESSAGE(self._dispatch)  # kept alive as long as the consumer
        register = _RegisterMessageCallbackOrderly if orderly else _RegisterMessageCallback
        _check(register(handle, self._callback), "register callback")

    def subscribe(self, topic: str, expression: str = "*") -> None:
        """Subscribe to `topic` (tags expression like "a || b", or "*"); call before start()."""
        _check(_Subscribe(self._require(), _text(topic, "topic"), _text(expression, "expression")), "Subscribe")

    def start(self) -> None:
        """Start pulling; the callback then runs on the library's consume threads."""
        _check(_StartPushConsumer(self._require()), "StartPushConsumer")
        self._started = True

    def shutdown(self, *, destroy: bool = True) -> None:
        """Stop pulling, persist offsets and (unless `destroy` is False) free the consumer.

        A long-running service leaves `destroy` False: under load a consume thread can still be
        returning from its callback when the library frees the consumer, and the process aborts
        ("mutex lock failed"); the consumer object is leaked instead, once, at exit.
        """
        if self._handle is None:
            return
        handle, self._handle = self._handle, None
        try:
            if self._started:
                _check(_ShutdownPushConsumer(handle), "ShutdownPushConsumer")
        finally:
            if destroy:
                _DestroyPushConsumer(handle)

    def __enter__(self) -> NativePushConsumer:
        """Start and return self."""
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Shut down."""
        self.shutdown()

    def _require(self) -> int:
        """Return the native handle, or raise once shut down."""
        if self._handle is None:
            raise NativeClientError("the consumer is shut down")
        return self._handle

    def _dispatch(self, _consumer: int | None, msg: int | None) -> int:
        """Library callback: decode one message and run the user's callback."""
        try:
            ok = self._on_message(read_message(msg or 0))
        except Exception:
            # An exception must not unwind into the library's thread; redeliver instead.
            _log.exception("consume callback failed; the message will be redelivered")
            return _RECONSUME_LATER
        return _CONSUME_SUCCESS if ok else _RECONSUME_LATER
