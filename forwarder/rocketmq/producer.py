"""The producer: messages for any topics sent in SEND_BATCH_MESSAGE requests, pipelined per broker.

Why: through the bundled client a single send costs ~100 µs of CPU inside the library, which caps
delivery at ~6-8k msg/s on two cores, and the client's own batch send is stored by a Java broker as
ONE message (its batch flag travels as "1", which Java parses as false). One SEND_BATCH_MESSAGE
request instead stores up to ~128 messages in one round trip, each under its own id, with its own
tags, keys and properties, for well under 10 µs of Python per message.

`RemotingProducer.send()` takes messages for any number of topics, groups them by topic, cuts each
group into batches (at most `max_batch_messages` messages and `max_batch_bytes` bytes), gives each
batch the next writable queue of its topic (round robin over all brokers' queues), writes every
request before reading any answer (pipelined, matched by opaque), and answers per message with a
`Receipt` or the typed error of its batch. It never retries a request the broker may have stored:
the caller retries (at-least-once); only batches whose broker could not even be connected to are
moved to another broker at once.

    SEND_BATCH_MESSAGE request: SendMessageRequestHeaderV2 in extFields, one letter a field:
      a producer group   b topic   c default topic (TBW102)   d queues of an auto-created topic
      e queue id   f sysFlag 0   g born timestamp (epoch ms)   h flag 0   i properties of the batch
      j reconsume times 0   k unit mode false   m batch true   n broker name
    body: the messages one after another (`codec.encode_message`)
    response: code 0 (or 10/11/12: stored, but not flushed or replicated in time), extFields
    queueId, queueOffset (of the first message; the others follow in order), msgId (offset ids).
"""

from __future__ import annotations

import logging
import random
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np

from forwarder.rocketmq.codec import BROKER_MAX_MESSAGE_BYTES, IdMaker, encode_message
from forwarder.rocketmq.connection import FENCED_NOTE, Connection
from forwarder.rocketmq.errors import (ConnectionFailedError, MessageRejectedError, RemotingError,
                                       TopicNotFoundError)
from forwarder.rocketmq.message import OutgoingMessage, Receipt
from forwarder.rocketmq._routes import DEFAULT_TOPIC, MAX_TOPICS, RouteCache
from forwarder.rocketmq._send_batch import (EncodedBatches, Outcome, SendBatch, batch_header, cut_encoded, fail,
                                             settle, stored_or_error)
from forwarder.rocketmq.namesrv import NameServerClient, TopicRoute
from forwarder.rocketmq.security import ClientSecurity
from forwarder.rocketmq.protocol import SEND_BATCH_MESSAGE, TOPIC_NOT_EXIST, Response

__all__ = ["DEFAULT_TOPIC", "Receipt", "RemotingProducer"]

log = logging.getLogger("timewheel.remoting")

#: a connection idle this long is probed for a peer that closed it (a restarted broker) before use
_PROBE_IDLE_S = 0.05


class RemotingProducer:
    """Sends messages to RocketMQ topics in SEND_BATCH_MESSAGE requests; thread-safe.

    Routes are looked up on the NameServer on first use, cached for `route_ttl_s` and refreshed
    sooner after a failure (at most every `route_retry_s`); while the NameServer cannot be reached
    or no longer lists a route it had (it drops a broker that stopped), the last route is kept.
    One persistent connection per broker. A topic without a route is sent through the default
    topic's route when `auto_create_topics` (as the bundled client does), so a broker configured
    with autoCreateTopicEnable creates it; otherwise it fails with TopicNotFoundError.
    """

    def __init__(
        self,
        namesrv: str,
        group: str,
        *,
        timeout_ms: int = 3000,
        route_ttl_s: float = 30.0,
        route_retry_s: float = 1.0,
        broker_backoff_s: float = 1.0,
        max_batch_messages: int = 128,
        max_batch_bytes: int = 1024 * 1024,
        max_message_bytes: int = BROKER_MAX_MESSAGE_BYTES,
        auto_create_topics: bool = True,
        security: ClientSecurity | None = None,
    ) -> None:
        """Configure (connects lazily); `namesrv` is "host:port", several separated by ';'."""
        self.security = security
        self._namesrv = NameServerClient(namesrv, timeout_ms / 1000, security)
        if max_batch_messages < 1 or max_batch_bytes < 1:
            raise ValueError("max_batch_messages and max_batch_bytes must be positive")
        self.group = group
        self.timeout = timeout_ms / 1000
        self.broker_backoff_s = broker_backoff_s
        self.max_batch_messages = max_batch_messages
        self.max_batch_bytes = max_batch_bytes
        self.max_message_bytes = max_message_bytes
        self._routes = RouteCache(self._namesrv, ttl_s=route_ttl_s, retry_s=route_retry_s,
                                  auto_create_topics=auto_create_topics)
        self._lock = threading.Lock()  # connections, queue cursors, back-offs
        self._cursor: dict[str, int] = {}  # topic -> its next queue (round robin)
        self._down_until: dict[str, float] = {}  # broker name -> no new connection before this
        self._conns: dict[str, Connection] = {}
        self._ids: IdMaker | None = None
        self._closed = False

    # -- sending --

    def send(self, messages: Sequence[OutgoingMessage],
             ids: Sequence[str] | None = None) -> list[Receipt | RemotingError]:
        """Send messages of any topics, under `ids` (their UNIQ_KEYs) or fresh ones; per message, its
        Receipt or the error of its batch."""
        if self._closed:
            raise ConnectionFailedError("the producer is closed")
        if not messages:
            return []
        deadline = time.monotonic() + self.timeout
        routes = self._routes.routes_of(m.topic for m in messages)
        out: list[Outcome] = [None] * len(messages)
        self._dispatch(self._cut(messages, routes, out, ids), routes, out, deadline, receipts=True)
        return [r if isinstance(r, (Receipt, RemotingError)) else ConnectionFailedError("not sent") for r in out]

    def send_to_every_queue(self, message: OutgoingMessage) -> list[Receipt | RemotingError]:
        """Send a copy of `message` to each writable queue of its topic (a control message every
        consumer must see, whatever queues it owns); per queue, its Receipt or error."""
        if self._closed:
            raise ConnectionFailedError("the producer is closed")
        deadline = time.monotonic() + self.timeout
        route = self._routes.route(message.topic)
        if route.via_default_topic:
            raise TopicNotFoundError(f"topic {message.topic} does not exist: it has no queues to send to",
                                     code=TOPIC_NOT_EXIST)
        out: list[Outcome] = [None] * len(route.queues)
        plans: dict[str, list[SendBatch]] = defaultdict(list)
        for i, (queue, msg_id) in enumerate(zip(route.queues, self._id_maker().next_ids(len(route.queues)))):
            data = encode_message(message, msg_id)
            batch = SendBatch(message.topic, [i], [msg_id], [data], len(data), queue)
            try:
                plans[self._connection(queue[0], route.brokers[queue[0]]).addr].append(batch)
            except RemotingError as e:
                fail(out, [batch], e)
        self._exchange(plans, out, deadline, receipts=True)
        return [r if isinstance(r, (Receipt, RemotingError)) else ConnectionFailedError("not sent") for r in out]

    def send_batch(self, topic: str, messages: Sequence[OutgoingMessage]) -> list[Receipt]:
        """Send messages of one topic in as few requests as the limits allow; raise the first error."""
        if any(m.topic != topic for m in messages):
            raise ValueError(f"every message must be for topic {topic}")
        receipts: list[Receipt] = []
        for r in self.send(messages):
            if isinstance(r, RemotingError):
                raise r
            receipts.append(r)
        return receipts

    def send_encoded(self, topics: Sequence[str], encoded: Sequence[bytes | RemotingError],
                     ids: Sequence[str], fence: Callable[[], bool] | None = None,
                     answers: np.ndarray | None = None) -> list[RemotingError | None]:
        """Send messages already encoded for a batch body (`codec.encode_message`, under `ids` from
        `new_ids`), or the error each could not be encoded with; per message, None once stored or
        the error of its batch. The hot path of delivery: no object per message on the way.

        `fence`, if given, is asked right before each broker's requests are written (under that
        connection's lock, once their bytes are ready: `Connection.submit`): False fails them with
        FencedError, unsent. A replica's lease deadline
        checked here, not only before encoding, leaves a paused process no window worth the name
        between its last look at the clock and the write.

        `answers`, if given (`storage.ANSWER_DTYPE`, one row per message), gets where the broker
        stored each message: queue id and offset, and its message id's store host and commit-log
        offset, taken from each batch's answer with a few numpy operations per batch."""
        if self._closed:
            raise ConnectionFailedError("the producer is closed")
        if not encoded:
            return []
        deadline = time.monotonic() + self.timeout
        routes = self._routes.routes_of(topics)
        out: list[Outcome] = [None] * len(encoded)
        self._dispatch(self._batches(topics, encoded, ids, routes, out), routes, out, deadline, receipts=False,
                       fence=fence, answers=answers)
        return stored_or_error(out)

    def send_batches(self, cut: EncodedBatches, fence: Callable[[], bool] | None = None,
                     answers: np.ndarray | None = None) -> list[RemotingError | None]:
        """`send_encoded` for messages already cut into batches within this producer's limits
        (`max_message_bytes`, `max_batch_messages`, `max_batch_bytes`) under `cut.ids`: per message,
        None once stored or the error of its batch (or of its row in `cut.rejected`)."""
        if self._closed:
            raise ConnectionFailedError("the producer is closed")
        if not cut.ids:
            return []
        deadline = time.monotonic() + self.timeout
        routes = self._routes.routes_of({b.topic for b in cut.batches} | {t for _, t, _ in cut.rejected})
        out: list[Outcome] = [None] * len(cut.ids)
        for i, topic, err in cut.rejected:
            route = routes[topic]
            out[i] = route if isinstance(route, RemotingError) else err  # as `cut_encoded` answers first
        batches = []
        for b in cut.batches:
            route = routes[b.topic]
            if isinstance(route, RemotingError):
                fail(out, [b], route)
            else:
                batches.append(b)
        self._dispatch(batches, routes, out, deadline, receipts=False, fence=fence, answers=answers)
        return stored_or_error(out)

    def new_ids(self, n: int) -> list[str]:
        """`n` fresh message ids (UNIQ_KEY) for `send_encoded`."""
        return self._id_maker().next_ids(n)

    def _dispatch(self, batches: list[SendBatch], routes: Mapping[str, TopicRoute | RemotingError],
                  out: list[Outcome], deadline: float, *, receipts: bool,
                  fence: Callable[[], bool] | None = None, answers: np.ndarray | None = None) -> None:
        """Place every batch on a queue of its topic and exchange them with the brokers."""
        if len(batches) == 1:  # the usual send: one request
            batch = batches[0]
            route = routes[batch.topic]
            assert isinstance(route, TopicRoute)
            try:
                addr = self._place(route, batch)
            except RemotingError as e:
                fail(out, batches, e)
                return
            self._exchange_one(addr, batch, out, deadline, receipts, fence, answers)
            return
        plans: dict[str, list[SendBatch]] = defaultdict(list)  # broker address -> its batches
        for batch in batches:
            route = routes[batch.topic]
            assert isinstance(route, TopicRoute)  # messages of failed topics are not cut into batches
            try:
                plans[self._place(route, batch)].append(batch)
            except RemotingError as e:
                fail(out, [batch], e)
        self._exchange(plans, out, deadline, receipts, fence, answers)

    def _cut(self, messages: Sequence[OutgoingMessage], routes: Mapping[str, TopicRoute | RemotingError],
             out: list[Outcome], ids: Sequence[str] | None = None) -> list[SendBatch]:
        """Encode every message of a routable topic (under `ids`, or fresh ones); cut batches per topic
        within the count and byte limits."""
        if ids is None:
            ids = self._id_maker().next_ids(len(messages))
        elif len(ids) != len(messages):
            raise ValueError(f"{len(ids)} ids for {len(messages)} messages")
        encoded: list[bytes | RemotingError] = []
        for m, msg_id in zip(messages, ids):
            if isinstance(routes[m.topic], RemotingError):
                encoded.append(b"")  # not encoded: its topic's error answers for it
                continue
            try:
                encoded.append(encode_message(m, msg_id))
            except MessageRejectedError as e:
                encoded.append(e)
        return self._batches([m.topic for m in messages], encoded, ids, routes, out)

    def _batches(self, topics: Sequence[str], encoded: Sequence[bytes | RemotingError], ids: Sequence[str],
                 routes: Mapping[str, TopicRoute | RemotingError], out: list[Outcome]) -> list[SendBatch]:
        """Cut encoded messages into batches within this producer's limits (`cut_encoded`)."""
        return cut_encoded(topics, encoded, ids, routes, out, max_message=self.max_message_bytes,
                           max_count=self.max_batch_messages, max_bytes=self.max_batch_bytes)

    def _place(self, route: TopicRoute, batch: SendBatch) -> str:
        """Give the batch the topic's next writable queue on a reachable broker; return its address."""
        tried: set[str] = set()
        while True:
            candidates: Sequence[tuple[str, int]]
            healthy: Sequence[tuple[str, int]]
            with self._lock:
                if not tried and not self._down_until:  # the usual case: every queue of the topic
                    candidates = healthy = route.queues
                else:
                    now = time.monotonic()
                    for broker in [b for b, until in self._down_until.items() if until <= now]:
                        del self._down_until[broker]  # back to the usual case once every backoff is over
                    candidates = [q for q in route.queues if q[0] not in tried]
                    healthy = [q for q in candidates if self._down_until.get(q[0], 0.0) <= now] or candidates
                if not healthy:
                    raise ConnectionFailedError(f"no reachable broker for topic {route.topic} "
                                                f"(tried {', '.join(sorted(tried)) or 'none'})")
                cursor = self._cursor.get(route.topic)
                if cursor is None:
                    if len(self._cursor) >= MAX_TOPICS:  # one-off topics; each cursor starts anywhere anyway
                        self._cursor.clear()
                    cursor = random.randrange(1 << 16)
                self._cursor[route.topic] = cursor + 1
                batch.queue = healthy[cursor % len(healthy)]
            name = batch.queue[0]
            try:
                return self._connection(name, route.brokers[name]).addr
            except ConnectionFailedError as e:
                # Nothing was sent: safe to try another broker of the topic at once.
                tried.add(name)
                self._routes.mark_stale(route.topic)
                log.debug("%s; trying another broker of %s", e, route.topic)
                if len(tried) >= len(route.brokers):
                    raise

    def _exchange(self, plans: Mapping[str, list[SendBatch]], out: list[Outcome],
                  deadline: float, receipts: bool, fence: Callable[[], bool] | None = None,
                  answers: np.ndarray | None = None) -> None:
        """Write every broker's requests, then read every answer (locks taken in address order)."""
        born = str(int(time.time() * 1000))
        held: list[tuple[Connection, list[SendBatch], list[int] | RemotingError]] = []
        try:
            for addr in sorted(plans):
                conn = self._conns.get(addr)
                if conn is None:  # closed meanwhile
                    fail(out, plans[addr], ConnectionFailedError(f"connection to {addr} was closed"))
                    continue
                conn.lock.acquire()
                requests = [(SEND_BATCH_MESSAGE, batch_header(self.group, b, born), b"".join(b.parts)) for b in plans[addr]]
                try:  # the fence is asked inside, right before the write
                    held.append((conn, plans[addr], conn.submit(requests, deadline, fence)))
                except RemotingError as e:
                    held.append((conn, plans[addr], e))
            for conn, batches, opaques in held:
                if isinstance(opaques, RemotingError):
                    self._settle(conn, batches, [opaques] * len(batches), out, receipts, answers)
                else:
                    got = conn.collect(opaques, deadline)
                    self._settle(conn, batches, [got[o] for o in opaques], out, receipts, answers)
        finally:
            for conn, _, _ in held:
                conn.lock.release()

    def _exchange_one(self, addr: str, b: SendBatch, out: list[Outcome], deadline: float, receipts: bool,
                      fence: Callable[[], bool] | None, answers: np.ndarray | None) -> None:
        """`_exchange` of one batch: its request written, its answer read, under the connection's lock."""
        conn = self._conns.get(addr)
        if conn is None:  # closed meanwhile
            fail(out, (b,), ConnectionFailedError(f"connection to {addr} was closed"))
            return
        reply: Response | RemotingError
        with conn.lock:
            request = (SEND_BATCH_MESSAGE, batch_header(self.group, b, str(int(time.time() * 1000))), b"".join(b.parts))
            try:  # the fence is asked inside, right before the write
                [opaque] = conn.submit((request,), deadline, fence)
                reply = conn.collect((opaque,), deadline)[opaque]
            except RemotingError as e:
                reply = e
            self._settle(conn, (b,), (reply,), out, receipts, answers)

    def _settle(self, conn: Connection, batches: Sequence[SendBatch], replies: Sequence[Response | RemotingError],
                out: list[Outcome], receipts: bool, answers: np.ndarray | None = None) -> None:
        """`settle` the replies; a broker that could not be reached is avoided a moment, a topic
        the broker refused (retriable, or not found) is looked up again."""
        settle(conn.addr, batches, replies, out, receipts, answers, self._broker_failed, self._routes.mark_stale)

    # -- routes --

    def route(self, topic: str) -> TopicRoute:
        """The topic's route: cached, looked up when missing, stale or older than `route_ttl_s`."""
        return self._routes.route(topic)

    def route_document(self, topic: str) -> dict[str, Any] | None:
        """The NameServer's TopicRouteData for `topic`, or None if it has none."""
        return self._routes.route_document(topic)

    def watch_routes(self, on_route: Callable[[str, Collection[str]], None]) -> None:
        """Call `on_route(topic, broker names)` with every route looked up on the NameServer from now on."""
        self._routes.on_route = on_route

    # -- connections --

    def _connection(self, broker: str, addr: str) -> Connection:
        """The live connection to `addr`, opened (again) if needed, unless the broker failed moments ago."""
        with self._lock:
            conn = self._conns.get(addr)
            # A connection written to a moment ago is used, not probed: a peer gone since then shows
            # in the answer (as it would between a probe and the write), and a probe is a system call.
            if conn is not None and not conn.closed and (time.monotonic() - conn.last_used < _PROBE_IDLE_S
                                                         or conn.alive()):
                return conn
            if time.monotonic() < self._down_until.get(broker, 0.0):
                # Connecting to a dead host can take the whole timeout: not again at once.
                raise ConnectionFailedError(f"broker {broker} at {addr} failed moments ago")
        try:
            fresh = Connection(addr, self.timeout, self.security)
        except ConnectionFailedError:
            with self._lock:
                self._down_until[broker] = time.monotonic() + self.broker_backoff_s
            raise
        with self._lock:
            if self._closed:
                fresh.close()
                raise ConnectionFailedError("the producer is closed")
            self._conns[addr] = fresh
        if conn is not None:
            log.info("reconnected to broker %s at %s", broker, addr)
        return fresh

    def _broker_failed(self, broker: str, topic: str) -> None:
        """Avoid the broker for a moment and look the topic's route up again before its next use."""
        with self._lock:
            self._down_until[broker] = time.monotonic() + self.broker_backoff_s
        self._routes.mark_stale(topic)

    def _id_maker(self) -> IdMaker:
        """Ids carry this host's address as the brokers see it (taken from the NameServer connection)."""
        if self._ids is None:
            ip = b"\x7f\x00\x00\x01"
            local = self._namesrv.local_ip()
            if local is not None:
                try:
                    ip = socket.inet_aton(local)
                except OSError:
                    pass  # not IPv4: keep loopback's, the id stays well-formed
            self._ids = IdMaker(ip)
        return self._ids

    def close(self) -> None:
        """Close every connection; sends afterwards fail."""
        with self._lock:
            self._closed = True
            conns, self._conns = list(self._conns.values()), {}
        for c in conns:
            with c.lock:
                c.close()
        self._namesrv.close()

    def __enter__(self) -> RemotingProducer:
        """Return self."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Close."""
        self.close()

