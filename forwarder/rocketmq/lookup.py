"""Look-ups on a topic by message id (UNIQ_KEY) through the brokers' message index: which of a set
of messages a topic already holds, and where.

    QUERY_MESSAGE (12), to each master broker of the topic (QueryMessageRequestHeader in extFields):
      topic, key (the UNIQ_KEY: the broker indexes `topic#key`), maxNum, beginTimestamp and
      endTimestamp (epoch ms), and `_UNIQUE_KEY_QUERY`=true (MixAll.UNIQUE_MSG_QUERY_FLAG: the
      broker then takes maxNum from its defaultQueryMaxNum, 32).
    response: SUCCESS with a body of stored messages one after another (as a pull returns them,
      `codec.decode_messages`), or QUERY_NOT_FOUND (22): nothing indexed under the key's hash in
      that window.

What the index promises, and so what this module checks (measured on RocketMQ 5.3.3):
- It compares only the key's hash (Java's `abs(String.hashCode())` of `topic#key`), so an answer
  may hold other messages, even of other topics: a copy counts only if its topic and UNIQ_KEY are
  exactly the ones asked for. At most 32 messages come back per key: an answer that full holding
  no match cannot say "missing", and says unknown.
- Its times are whole seconds of the broker's store clock, and a message is indexed a few ms after
  its send is acknowledged (p99 ~10-24 ms): begin a window at least 2 s before the earliest send,
  less any clock skew, and end it after the latest (never begin at 0, a measured pitfall: it is
  refused here).
- A broker killed with `messageIndexSafe=false` (the default) loses most recent index entries on
  restart: only brokers with `messageIndexSafe=true` answer "missing" truthfully after a crash.
A broker that cannot be reached, or answers with an error, leaves its keys unknown, never missing.

Routes are cached `route_ttl_s`; an expired one is let go at the next look-up, and beyond
`MAX_ROUTES` the least recently used one is, so the table holds the topics looked up lately, not
every target topic ever checked.
"""
from __future__ import annotations

import enum
import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from forwarder.rocketmq.codec import decode_messages
from forwarder.rocketmq.connection import Connection, host_port_ok
from forwarder.rocketmq.errors import ConnectionFailedError, ProtocolError, RemotingError, TopicNotFoundError
from forwarder.rocketmq.message import UNIQ_KEY, ReceivedMessage
from forwarder.rocketmq.namesrv import NameServerClient
from forwarder.rocketmq.protocol import QUERY_MESSAGE, QUERY_NOT_FOUND, SUCCESS, TOPIC_NOT_EXIST, error_for_code
from forwarder.rocketmq.security import ClientSecurity

__all__ = ["Copy", "KeyLookup", "LookupState", "MAX_ROUTES", "MessageLookup", "UNIQUE_KEY_QUERY_MAX", "answer_copies",
           "matching", "query_broker"]

#: the most messages a broker returns for a unique-key query (its defaultQueryMaxNum)
UNIQUE_KEY_QUERY_MAX = 32
_UNIQUE_KEY_QUERY = "_UNIQUE_KEY_QUERY"  # MixAll.UNIQUE_MSG_QUERY_FLAG
_IN_FLIGHT = 256  # requests written to one broker before reading answers: bounds what is buffered
#: routes a MessageLookup keeps at most; past it the least recently used one goes
MAX_ROUTES = 10_000


class LookupState(enum.Enum):
    """What a look-up of one key established."""

    FOUND = "found"  # at least one copy with exactly this UNIQ_KEY is stored on the topic
    MISSING = "missing"  # every broker of the topic answered, and none holds it in the window
    UNKNOWN = "unknown"  # no copy seen, and some broker could not say


@dataclass(frozen=True, slots=True)
class Copy:
    """One stored copy of a looked-up message."""

    broker: str  # broker name
    queue_id: int
    queue_offset: int
    commit_log_offset: int
    store_timestamp: int  # epoch ms, the broker's clock


@dataclass(frozen=True, slots=True)
class KeyLookup:
    """The copies of one UNIQ_KEY found on a topic, and the errors of the brokers that could not answer."""

    key: str
    copies: tuple[Copy, ...] = ()
    errors: tuple[str, ...] = field(default=())

    @property
    def state(self) -> LookupState:
        """FOUND if any copy was seen (whatever else failed), MISSING only if every broker answered."""
        if self.copies:
            return LookupState.FOUND
        return LookupState.UNKNOWN if self.errors else LookupState.MISSING


def _check_window(begin_ms: int, end_ms: int) -> None:
    """Refuse a window the index cannot answer truthfully."""
    if begin_ms <= 0:
        raise ValueError(f"begin_ms must be a positive epoch ms, not {begin_ms}")
    if end_ms < begin_ms:
        raise ValueError(f"the window ends ({end_ms}) before it begins ({begin_ms})")


def _request(topic: str, key: str, begin_ms: int, end_ms: int) -> tuple[int, dict[str, str], bytes]:
    """One QUERY_MESSAGE request for `key` on `topic`."""
    return (QUERY_MESSAGE, {"topic": topic, "key": key, "maxNum": str(UNIQUE_KEY_QUERY_MAX),
                            "beginTimestamp": str(begin_ms), "endTimestamp": str(end_ms),
                            _UNIQUE_KEY_QUERY: "true"}, b"")


def matching(messages: Iterable[ReceivedMessage], topic: str, key: str, broker: str) -> list[Copy]:
    """The copies among an answer's messages whose topic and UNIQ_KEY are exactly `topic` and `key`."""
    # The index matched a hash: compare the property itself (not msg_id, which falls back to the
    # broker's offset id for a message without UNIQ_KEY).
    return [Copy(broker, m.queue_id, m.queue_offset, m.commit_log_offset, m.store_timestamp)
            for m in messages if m.topic == topic and m.properties.get(UNIQ_KEY) == key]


def answer_copies(code: int, remark: str | None, body: bytes, topic: str, key: str,
                  broker: str) -> list[Copy] | RemotingError:
    """A QUERY_MESSAGE answer for `key` from `broker` as its matching copies, or the error it means."""
    if code == QUERY_NOT_FOUND:
        return []
    if code != SUCCESS:
        return error_for_code(code, remark, f"broker {broker} querying {topic}#{key}")
    try:
        messages = decode_messages(body, broker=broker)
    except ProtocolError as e:
        return e
    copies = matching(messages, topic, key, broker)
    if not copies and len(messages) >= UNIQUE_KEY_QUERY_MAX:
        # full of other messages under the same hash: the one asked for may be past the cap
        return ProtocolError(f"broker {broker}: {len(messages)} messages under the hash of {key}, none of them it; "
                             f"the answer is capped at {UNIQUE_KEY_QUERY_MAX}")
    return copies


def query_broker(conn: Connection, broker: str, topic: str, keys: Sequence[str], begin_ms: int, end_ms: int,
                 deadline: float) -> dict[str, list[Copy] | RemotingError]:
    """Per key, its copies on `topic` held by the broker behind `conn` (named `broker`), or the error
    that left it unanswered; requests pipelined, `_IN_FLIGHT` at a time (the caller holds `conn.lock`)."""
    _check_window(begin_ms, end_ms)
    out: dict[str, list[Copy] | RemotingError] = {}
    for start in range(0, len(keys), _IN_FLIGHT):
        chunk = keys[start:start + _IN_FLIGHT]
        try:
            opaques = conn.submit([_request(topic, k, begin_ms, end_ms) for k in chunk], deadline)
        except RemotingError as e:
            out.update((k, e) for k in keys[start:])
            return out
        got = conn.collect(opaques, deadline)
        for k, o in zip(chunk, opaques):
            answer = got[o]
            out[k] = answer if isinstance(answer, RemotingError) else answer_copies(
                answer.code, answer.remark, answer.body, topic, k, broker)
    return out


class MessageLookup:
    """Looks UNIQ_KEYs up on every master broker of a topic's route; thread-safe, connections kept."""

    def __init__(self, namesrv: str, *, timeout_ms: int = 3000, route_ttl_s: float = 30.0,
                 security: ClientSecurity | None = None, max_routes: int = MAX_ROUTES) -> None:
        """Configure (connects lazily); `namesrv` is "host:port", several separated by ';'."""
        if max_routes < 1:
            raise ValueError("max_routes must be at least 1")
        self.timeout = timeout_ms / 1000
        self.route_ttl_s = route_ttl_s
        self.max_routes = max_routes
        self.security = security
        self._namesrv = NameServerClient(namesrv, self.timeout, security)
        self._lock = threading.Lock()
        # topic -> (fetched, broker name -> master), least recently used first
        self._routes: OrderedDict[str, tuple[float, dict[str, str]]] = OrderedDict()
        self._conns: dict[str, Connection] = {}

    def lookup(self, topic: str, keys: Sequence[str], begin_ms: int, end_ms: int) -> dict[str, KeyLookup]:
        """Per distinct key, its copies on `topic` stored in [begin_ms, end_ms] (broker clock, epoch ms)."""
        _check_window(begin_ms, end_ms)
        keys = list(dict.fromkeys(keys))
        copies: dict[str, list[Copy]] = {k: [] for k in keys}
        errors: dict[str, list[str]] = {k: [] for k in keys}
        try:
            brokers = self.brokers(topic)
        except RemotingError as e:
            return {k: KeyLookup(k, (), (f"{type(e).__name__}: {e}",)) for k in keys}
        deadline = time.monotonic() + self.timeout
        ask = lambda item: self._ask(item[0], item[1], topic, keys, begin_ms, end_ms, deadline)  # noqa: E731
        if len(brokers) == 1:
            answers = [ask(next(iter(brokers.items())))]
        else:  # every broker at once: each answers its share while the others do
            with ThreadPoolExecutor(len(brokers), thread_name_prefix="timewheel-lookup") as pool:
                answers = list(pool.map(ask, sorted(brokers.items())))
        for answered in answers:
            for k, got in answered.items():
                if isinstance(got, RemotingError):
                    errors[k].append(f"{type(got).__name__}: {got}")
                else:
                    copies[k] += got
        return {k: KeyLookup(k, tuple(copies[k]), tuple(errors[k])) for k in keys}

    def brokers(self, topic: str) -> dict[str, str]:
        """The master of every broker holding queues of `topic` (readable or writable), cached; a route
        without a broker, or a broker set without a master, raises (its keys are unknown, never missing)."""
        with self._lock:
            cached = self._routes.get(topic)
            if cached is not None and time.monotonic() - cached[0] < self.route_ttl_s:
                self._routes.move_to_end(topic)
                return cached[1]
        doc = self._namesrv.route_document(topic)
        if doc is None:
            raise TopicNotFoundError(f"topic {topic} has no route on the NameServer", code=TOPIC_NOT_EXIST)
        try:
            # Any queue set counts: a broker whose write permission was withdrawn still holds what it stored.
            named = {q["brokerName"] for q in doc.get("queueDatas", ())}
            brokers = {b["brokerName"]: b["brokerAddrs"]["0"] for b in doc.get("brokerDatas", ())
                       if b["brokerName"] in named and "0" in (b.get("brokerAddrs") or {})}
        except (KeyError, TypeError, AttributeError) as e:
            raise ProtocolError(f"the NameServer's route of {topic} has an unexpected shape: "
                                f"{json.dumps(doc)[:200]}") from e
        bad = {name: addr for name, addr in brokers.items() if not host_port_ok(addr)}
        if bad:
            raise ProtocolError(f"the NameServer's route of {topic} names broker(s) at an address that is not "
                                f"HOST:PORT: {bad}")
        if not named:
            # no broker asked is no broker that answered: never a "missing"
            raise TopicNotFoundError(f"the NameServer's route of {topic} names no broker", code=TOPIC_NOT_EXIST)
        if len(brokers) < len(named):
            # a broker set without a master cannot answer; say so rather than count it as "missing"
            raise ConnectionFailedError(f"broker(s) {sorted(named - set(brokers))} of {topic} have no master")
        now = time.monotonic()
        with self._lock:
            self._routes[topic] = (now, brokers)
            self._routes.move_to_end(topic)
            self._let_go(now)
        return brokers

    def _let_go(self, now: float) -> None:
        """Forget the least recently used routes: those expired, and any past `max_routes` (the lock held)."""
        while self._routes:
            topic, (fetched, _) = next(iter(self._routes.items()))
            if len(self._routes) <= self.max_routes and now - fetched < self.route_ttl_s:
                return
            del self._routes[topic]

    def _ask(self, name: str, addr: str, topic: str, keys: Sequence[str], begin_ms: int, end_ms: int,
             deadline: float) -> Mapping[str, list[Copy] | RemotingError]:
        """One broker's answers for every key (its connection opened again if needed)."""
        try:
            conn = self._connection(addr)
        except RemotingError as e:
            self._forget(topic)
            return {k: e for k in keys}
        with conn.lock:
            answers = query_broker(conn, name, topic, keys, begin_ms, end_ms, deadline)
        if any(isinstance(a, ConnectionFailedError) for a in answers.values()):
            self._forget(topic)
        return answers

    def _connection(self, addr: str) -> Connection:
        """The live connection to `addr`, opened if needed."""
        with self._lock:
            conn = self._conns.get(addr)
            if conn is not None and conn.alive():
                return conn
        fresh = Connection(addr, self.timeout, self.security)
        with self._lock:
            self._conns[addr] = fresh
        return fresh

    def _forget(self, topic: str) -> None:
        """Look the topic's route up again next time (a broker of it failed: it may have moved)."""
        with self._lock:
            self._routes.pop(topic, None)

    def close(self) -> None:
        """Close every connection."""
        with self._lock:
            conns, self._conns = list(self._conns.values()), {}
        for c in conns:
            with c.lock:
                c.close()
        self._namesrv.close()

    def __enter__(self) -> MessageLookup:
        """Return self."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Close."""
        self.close()
