"""The consumer: one member of a clustering consumer group, pulling batches; offsets committed after.

Why: the bundled client's push consumer hands Python one message per callback, each on one of its
threads taking the GIL in turn; ingest then spends ~200 µs of CPU per message on two cores (most
of it threads handing the GIL around) and stores them in commits of a few messages. Pulling
batches ourselves gives one callback (and one store commit) per batch: every pull answer already
read when one arrives (each of up to `pull_batch`), so commits grow with the load.

How it behaves, as RocketMQ's own clients do:
- membership: a heartbeat to every broker of the topic every `rebalance_interval_s` registers
  this client in the group; then the group's members (GET_CONSUMER_LIST_BY_GROUP) and the topic's
  read queues are sorted and split evenly (AllocateMessageQueueAveragely), so members agree
  without talking to each other. A member that stops unregisters; one that dies is dropped by
  the broker when its connection closes. Queues move at the next rebalance of each member.
- pulling: one thread per broker keeps one long-polling PULL_MESSAGE in flight per owned queue
  (pipelined on one connection, matched by opaque); the broker answers as soon as messages
  arrive, or after `suspend_ms` with none.
- at-least-once: a batch's offset is committed (piggybacked on the next pull of that queue, and
  explicitly when the queue is released or the consumer stops) only after the callback accepted
  the batch. A batch the callback refuses is pulled again after `retry_backoff_s`. A queue that
  moves to another member is consumed there from the last committed offset: what this member
  accepted after that is delivered again (the dedup id makes it one record per engine).
- a group with no committed offset on a queue starts from the queue's first message: a delay
  service must not skip what producers sent before it first started.

Wire formats used here (apache/rocketmq, 5.x):
    PULL_MESSAGE (11) extFields: consumerGroup, topic, queueId, queueOffset, maxMsgNums, sysFlag
      (1 commit offset, 2 suspend, 4 subscription), commitOffset, suspendTimeoutMillis,
      subscription, subVersion, expressionType. Answers: 0 found (body: messages), 19 none new,
      20 retry now, 21 offset moved; extFields nextBeginOffset, minOffset, maxOffset.
    body: stored messages one after another (`codec.decode_messages`).
    QUERY_CONSUMER_OFFSET (14) / UPDATE_CONSUMER_OFFSET (15): consumerGroup, topic, queueId
      [, commitOffset]; 22 = no offset stored. GET_MIN_OFFSET (31): topic, queueId -> offset.
    HEART_BEAT (34): body {"clientID", "producerDataSet": [], "consumerDataSet": [...]}.
    UNREGISTER_CLIENT (35): clientID, consumerGroup. GET_CONSUMER_LIST_BY_GROUP (38):
      consumerGroup -> body {"consumerIdList": [...]}.

Requests a broker sends this member (on the connection it heartbeats on; answered as RocketMQ's
Java client does, bodies in `consumer_status`):
- NOTIFY_CONSUMER_IDS_CHANGED (40): a member joined or left: rebalance now, not at the next round.
- RESET_CONSUMER_CLIENT_OFFSET (220): an operator moved the group (`mqadmin resetOffsetByTime` on a
  broker that leaves resets to its clients): each named queue this member owns is pulled from the
  given offset next, and that offset is committed with the next pull. A pull answered meanwhile
  for the old offset is dropped. (Brokers that reset on their side answer the next pull
  PULL_OFFSET_MOVED with the new offset instead; that is followed the same way.)
- GET_CONSUMER_STATUS_FROM_CLIENT (221): each owned queue's offset.
- GET_CONSUMER_RUNNING_INFO (307): settings, subscription, owned queues with their offsets and
  last pull and consume times, counters (`mqadmin consumerStatus`, `consumerProgress -s true`).
- anything else: REQUEST_CODE_NOT_SUPPORTED with a remark naming the code (one-way ones: logged).
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Sequence

from forwarder.rocketmq.codec import BROKER_MAX_MESSAGE_BYTES, decode_messages
from forwarder.rocketmq.compression import InflateBudget
from forwarder.rocketmq.connection import Connection
from forwarder.rocketmq.consumer_status import QueueReport, consumer_status_body, parse_reset_offsets, running_info_body
from forwarder.rocketmq.errors import MessageDecodeError, ProtocolError, RemotingError
from forwarder.rocketmq.message import ReceivedMessage
from forwarder.rocketmq.namesrv import NameServerClient, parse_route
from forwarder.rocketmq.security import ClientSecurity
from forwarder.rocketmq.protocol import (GET_CONSUMER_LIST_BY_GROUP, GET_CONSUMER_RUNNING_INFO,
                                         GET_CONSUMER_STATUS_FROM_CLIENT, GET_MIN_OFFSET, HEART_BEAT,
                                         NOTIFY_CONSUMER_IDS_CHANGED, PULL_MESSAGE, PULL_NOT_FOUND, PULL_OFFSET_MOVED,
                                         PULL_RETRY_IMMEDIATELY, QUERY_CONSUMER_OFFSET, QUERY_NOT_FOUND,
                                         REQUEST_CODE_NOT_SUPPORTED, RESET_CONSUMER_CLIENT_OFFSET, SUCCESS,
                                         SYSTEM_ERROR, UNREGISTER_CLIENT, UPDATE_CONSUMER_OFFSET, Reply, Request,
                                         Response, error_for_code)

__all__ = ["BatchCallback", "Queue", "RemotingPullConsumer", "allocate_averagely"]

log = logging.getLogger("timewheel.pull")

_FLAG_COMMIT_OFFSET = 1
_FLAG_SUSPEND = 2
_FLAG_SUBSCRIPTION = 4
#: how often the connections the broker may ask this member something on are looked at
_SERVE_INTERVAL_S = 0.05
#: pull answers stored in one commit at most (each up to `pull_batch` messages)
_MAX_ANSWERS_PER_COMMIT = 32

#: (broker name, queue id)
Queue = tuple[str, int]
#: accepts a batch (True: stored or dead-lettered, commit it) or refuses it (False: pull it again)
BatchCallback = Callable[[list[ReceivedMessage]], bool]


def allocate_averagely(queues: Sequence[Queue], members: Sequence[str], me: str) -> list[Queue]:
    """This member's share of the queues, as RocketMQ's AllocateMessageQueueAveragely splits them."""
    mq, cids = sorted(queues), sorted(members)
    if me not in cids or not mq:
        return []
    index, n, m = cids.index(me), len(mq), len(cids)
    mod = n % m
    size = 1 if n <= m else (n // m + 1 if mod > 0 and index < mod else n // m)
    start = index * size if mod > 0 and index < mod else index * size + mod
    return [mq[(start + i) % n] for i in range(min(size, n - start))]


@dataclass
class _QueueState:
    offset: int  # next offset to pull
    committed: int  # last offset committed to the broker (-1: the broker must be told `offset`)
    in_flight: int | None = None  # opaque of the outstanding pull
    retry_at: float = 0.0  # monotonic time before which it is not pulled (a refused batch)
    released: bool = False  # assigned to another member: its pull thread commits and drops it
    decode_failures: int = 0  # pulls in a row at this offset whose body could not be framed
    last_pull_ms: int = 0  # wall clock of the last answered pull (reported to admin tools)
    last_consume_ms: int = 0  # wall clock of the last batch accepted
    sent_ms: int = 0  # wall-clock ms when the pull in flight was sent
    caught_up_ms: int = 0  # wall-clock ms before which everything stored in the queue was accepted


class RemotingPullConsumer:
    """One member of a clustering consumer group on one topic; see the module docstring."""

    def __init__(self, namesrv: str, group: str, topic: str, on_batch: BatchCallback, *,
                 pull_batch: int = 32, suspend_ms: int = 1000, rebalance_interval_s: float = 2.0,
                 retry_backoff_s: float = 1.0, timeout_ms: int = 3000, client_id: str | None = None,
                 max_body_bytes: int = BROKER_MAX_MESSAGE_BYTES, max_decode_tries: int = 3,
                 max_commit_inflated_bytes: int = 64 << 20,
                 security: ClientSecurity | None = None,
                 queue_filter: Callable[[Queue], bool] | None = None) -> None:
        """Configure (nothing connects until start()).

        A pull body that cannot be framed is pulled again up to `max_decode_tries` times; then its
        unreadable rest goes to `on_batch` as one `undecodable` message and the queue moves on.
        `queue_filter`: only queues it accepts are shared out in the group (a replica's shard).
        """
        self.queue_filter = queue_filter
        self.max_body_bytes = max_body_bytes
        #: compressed bodies of one commit inflate to at most this (plus one message) in all
        self.max_commit_inflated_bytes = max_commit_inflated_bytes
        self.max_decode_tries = max_decode_tries
        self.group = group
        self.topic = topic
        self.on_batch = on_batch
        self.pull_batch = pull_batch
        self.suspend_ms = suspend_ms
        self.rebalance_interval_s = rebalance_interval_s
        self.retry_backoff_s = retry_backoff_s
        self.timeout = timeout_ms / 1000
        self.client_id = client_id or f"{socket.gethostname()}@{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.security = security
        self._namesrv = NameServerClient(namesrv, self.timeout, security)
        self._lock = threading.Lock()
        self._brokers: dict[str, str] = {}  # broker name -> master address
        self._owned: dict[Queue, _QueueState] = {}
        #: per queue ever consumed here, the offset below which every message was accepted (kept after
        #: the queue moves away: what was stored stays stored)
        self._stored: dict[Queue, int] = {}
        self._control: dict[str, Connection] = {}  # broker address -> connection for control requests
        self._running = threading.Event()
        self._stopping = threading.Event()
        self._threads: dict[str, threading.Thread] = {}
        self._rebalancer: threading.Thread | None = None
        self._rebalance_now = threading.Event()
        self._started_ms = 0
        self.counters = {"pulled": 0, "batches": 0, "refused": 0, "rebalances": 0, "undecodable": 0,
                         "offset_resets": 0}
        #: a replica's own start offsets (`broker:queue id` -> offset; set before start()): a queue it
        #: names starts there, any other at its earliest retained offset, whatever the group committed
        self.start_offsets: dict[str, int] | None = None
        #: every PULL_OFFSET_MOVED answer, as "<broker>:<queue id> <from> -> <to>" (a gap in what was read)
        self.offsets_moved: list[str] = []

    # -- lifecycle --

    def start(self) -> None:
        """Join the group, take this member's queues and start pulling."""
        self._running.set()
        self._stopping.clear()
        self._started_ms = int(time.time() * 1000)
        self._rebalance()
        self._rebalancer = threading.Thread(target=self._rebalance_loop, name="ingest-rebalance", daemon=True)
        self._rebalancer.start()

    def stop(self) -> None:
        """Stop pulling, commit what was accepted, and leave the group (others take the queues over)."""
        self._stopping.set()
        if self._rebalancer is not None:
            self._rebalancer.join()
        self._running.clear()
        for t in list(self._threads.values()):
            t.join()
        self._threads.clear()
        with self._lock:
            owned, self._owned = dict(self._owned), {}
        for q, st in owned.items():
            self._commit(q, st)
        for addr in set(self._brokers.values()):
            try:
                self._request(addr, UNREGISTER_CLIENT, {"clientID": self.client_id, "consumerGroup": self.group})
            except RemotingError as e:
                log.warning("could not leave group %s on %s: %s", self.group, addr, e)
        for c in self._control.values():
            c.close()
        self._control.clear()
        self._namesrv.close()

    def owned(self) -> list[Queue]:
        """The queues this member consumes now."""
        with self._lock:
            return sorted(q for q, st in self._owned.items() if not st.released)

    def caught_up_ms(self) -> int | None:
        """Wall-clock ms before which every message stored in every owned queue was accepted (None: owns
        none): the earliest of the queues' last pulls that found nothing more to read."""
        with self._lock:
            marks = [st.caught_up_ms for st in self._owned.values() if not st.released]
        return min(marks) if marks else None

    def stored_offsets(self) -> dict[str, int]:
        """Per queue (`broker:queue id`), the offset below which every message was accepted by the
        callback, since this member started from where it started (replica sets publish it)."""
        with self._lock:
            return {f"{b}:{qid}": o for (b, qid), o in self._stored.items()}

    def _accepted_below(self, q: Queue, offset: int) -> None:
        with self._lock:
            if offset > self._stored.get(q, -1):
                self._stored[q] = offset

    def members(self) -> list[str]:
        """The group's members as the broker lists them now (client ids)."""
        return self._members()

    # -- membership --

    def _rebalance_loop(self) -> None:
        """Rebalance every `rebalance_interval_s` (at once when the broker says the members changed),
        and answer what the broker asks on the control connections in between."""
        next_at = time.monotonic() + self.rebalance_interval_s
        while not self._stopping.wait(_SERVE_INTERVAL_S):
            with self._lock:
                control = list(self._control.values())
            for conn in control:
                conn.serve_requests()
            if not self._rebalance_now.is_set() and time.monotonic() < next_at:
                continue
            self._rebalance_now.clear()
            next_at = time.monotonic() + self.rebalance_interval_s
            try:
                self._rebalance()
            except Exception:  # keep the member alive; the next round tries again
                log.exception("rebalance of %s failed", self.group)

    # -- what the broker asks --

    def answer(self, req: Request) -> Reply | None:
        """Answer a request a broker sent this member (see the module docstring); None: no answer."""
        if req.code == NOTIFY_CONSUMER_IDS_CHANGED:
            self._rebalance_now.set()
            return None
        if req.code == RESET_CONSUMER_CLIENT_OFFSET:
            if req.ext.get("group") == self.group and req.ext.get("topic") == self.topic:
                self.reset_offsets({(broker, qid): offset
                                    for (topic, broker, qid), offset in parse_reset_offsets(req.body).items()
                                    if topic == self.topic})
            return None
        if req.code == GET_CONSUMER_STATUS_FROM_CLIENT:
            mine = req.ext.get("group") == self.group and req.ext.get("topic") == self.topic
            return SUCCESS, None, consumer_status_body(self._reports() if mine else [])
        if req.code == GET_CONSUMER_RUNNING_INFO:
            if req.ext.get("consumerGroup") != self.group:
                group = req.ext.get("consumerGroup")
                return SYSTEM_ERROR, f"The Consumer Group <{group}> not exist in this consumer", b""
            return SUCCESS, None, running_info_body(self._properties(), self.topic, self._reports(), self.counters)
        if req.oneway:
            log.warning("a broker sent request code %d, which this consumer does not handle; ignored", req.code)
            return None
        return REQUEST_CODE_NOT_SUPPORTED, f"request code {req.code} is not supported by the timewheel consumer", b""

    def reset_offsets(self, offsets: dict[Queue, int]) -> None:
        """Pull each named queue this member owns from the given offset next, and commit that offset.

        What was accepted past it is read again: the engine stores a message id once, so those are
        counted as duplicates, not scheduled twice. Queues this member does not own are left to
        their owner (the broker tells every member).
        """
        with self._lock:
            moved = 0
            for q, offset in offsets.items():
                st = self._owned.get(q)
                if st is None or st.released:
                    continue
                # A new state: the answer to a pull still in flight for the old offset is dropped.
                self._owned[q] = _QueueState(offset, -1)
                moved += 1
        if moved:
            self.counters["offset_resets"] += moved
            log.warning("group %s: %d queue(s) of %s reset by the broker: %s", self.group, moved, self.topic,
                        {f"{q[0]}:{q[1]}": o for q, o in sorted(offsets.items())})

    def _reports(self) -> list[QueueReport]:
        with self._lock:
            return [QueueReport(self.topic, q[0], q[1], st.offset, max(st.committed, 0), st.last_pull_ms,
                                st.last_consume_ms) for q, st in self._owned.items() if not st.released]

    def _properties(self) -> dict[str, str]:
        return {"PROP_NAMESERVER_ADDR": ";".join(self._namesrv.addrs), "PROP_CONSUME_TYPE": "CONSUME_PASSIVELY",
                "PROP_CONSUMEORDERLY": "false", "PROP_THREADPOOL_CORE_SIZE": str(max(len(self._threads), 1)),
                "PROP_CLIENT_VERSION": "timewheel remoting client", "PROP_CONSUMER_START_TIMESTAMP":
                str(self._started_ms), "consumerGroup": self.group, "messageModel": "CLUSTERING",
                "consumeFromWhere": "CONSUME_FROM_FIRST_OFFSET", "pullBatchSize": str(self.pull_batch),
                "clientId": self.client_id}

    def _read_queues(self) -> list[Queue]:
        data = self._namesrv.route_document(self.topic)
        if data is None:
            return []
        route = parse_route(self.topic, data, readable=True)
        with self._lock:
            self._brokers = dict(route.brokers)
        return [q for q in route.queues if self.queue_filter is None or self.queue_filter(q)]

    def _heartbeat(self) -> None:
        body = json.dumps({
            "clientID": self.client_id, "producerDataSet": [],
            "consumerDataSet": [{
                "groupName": self.group, "consumeType": "CONSUME_PASSIVELY", "messageModel": "CLUSTERING",
                "consumeFromWhere": "CONSUME_FROM_FIRST_OFFSET", "unitMode": False,
                "subscriptionDataSet": [{"classFilterMode": False, "topic": self.topic, "subString": "*",
                                         "tagsSet": [], "codeSet": [], "subVersion": int(time.time() * 1000),
                                         "expressionType": "TAG"}]}]}).encode()
        for addr in set(self._brokers.values()):
            self._request(addr, HEART_BEAT, {}, body)

    def _members(self) -> list[str]:
        for addr in sorted(set(self._brokers.values())):
            resp = self._request(addr, GET_CONSUMER_LIST_BY_GROUP, {"consumerGroup": self.group})
            try:
                return list(json.loads(resp.body).get("consumerIdList") or [])
            except ValueError as e:
                raise ProtocolError(f"consumer list of {self.group} from {addr} is not JSON: {e}") from e
        return []

    def _rebalance(self) -> None:
        queues = self._read_queues()
        self._heartbeat()
        mine = set(allocate_averagely(queues, self._members(), self.client_id))
        with self._lock:
            released = [q for q, st in self._owned.items() if q not in mine and not st.released]
            added = [q for q in mine if q not in self._owned or self._owned[q].released]
        for q in sorted(added):
            offset = self._start_offset(q)
            self._accepted_below(q, offset)
            with self._lock:
                self._owned[q] = _QueueState(offset, offset)
        with self._lock:
            for q in released:
                self._owned[q].released = True  # its pull thread commits what it accepted, then drops it
        if released or added:
            self.counters["rebalances"] += 1
            log.info("group %s: now consuming %d queue(s) of %s (+%d -%d)", self.group, len(mine), self.topic,
                     len(added), len(released))
        for name in sorted({q[0] for q in mine} | {q[0] for q in released}):
            t = self._threads.get(name)
            if t is None or not t.is_alive():
                t = threading.Thread(target=self._pull_loop, args=(name,), name=f"ingest-pull-{name}", daemon=True)
                self._threads[name] = t
                t.start()

    def _start_offset(self, q: Queue) -> int:
        addr = self._brokers[q[0]]
        own = self.start_offsets.get(f"{q[0]}:{q[1]}") if self.start_offsets is not None else None
        if own is not None:
            return own
        ext = {"consumerGroup": self.group, "topic": self.topic, "queueId": str(q[1])}
        resp = self._request(addr, QUERY_CONSUMER_OFFSET, ext, ok=(SUCCESS, QUERY_NOT_FOUND))
        if resp.code == SUCCESS and int(resp.ext.get("offset", -1)) >= 0 and self.start_offsets is None:
            return int(resp.ext["offset"])
        resp = self._request(addr, GET_MIN_OFFSET, {"topic": self.topic, "queueId": str(q[1])})
        return int(resp.ext.get("offset", 0))

    def _commit(self, q: Queue, st: _QueueState) -> None:
        if st.offset <= st.committed:
            return
        try:
            self._request(self._brokers[q[0]], UPDATE_CONSUMER_OFFSET,
                          {"consumerGroup": self.group, "topic": self.topic, "queueId": str(q[1]),
                           "commitOffset": str(st.offset)})
            st.committed = st.offset
        except RemotingError as e:  # the next owner starts earlier: duplicates, never loss
            log.warning("could not commit offset %d of %s/%s: %s", st.offset, self.topic, q, e)

    def _request(self, addr: str, code: int, ext: dict[str, str], body: bytes = b"", *,
                 ok: tuple[int, ...] = (SUCCESS,)) -> Response:
        with self._lock:
            conn = self._control.get(addr)
            if conn is None or not conn.alive():
                conn = self._control[addr] = Connection(addr, self.timeout, self.security, self.answer)
        resp = conn.request(code, ext, body, time.monotonic() + self.timeout)
        if resp.code not in ok:
            raise error_for_code(resp.code, resp.remark, f"broker {addr} (request {code})")
        return resp

    # -- pulling --

    def _pull_loop(self, broker: str) -> None:
        """Keep one pull in flight per owned queue of `broker`; hand each batch to the callback."""
        conn: Connection | None = None
        pending: dict[int, Queue] = {}
        while self._running.is_set():
            with self._lock:
                mine = {q: st for q, st in self._owned.items() if q[0] == broker}
                addr = self._brokers.get(broker)
            for q, st in list(mine.items()):
                if st.released:  # nothing of it is being handled on this thread now: hand it over
                    self._commit(q, st)
                    with self._lock:
                        if self._owned.get(q) is st:
                            del self._owned[q]
                    del mine[q]
                    pending = {o: pq for o, pq in pending.items() if pq != q}
            if not mine or addr is None:
                break
            try:
                if conn is None or conn.closed:
                    conn = Connection(addr, self.timeout, self.security, self.answer)
                    pending.clear()
                    with self._lock:
                        for st in mine.values():
                            if st.in_flight is not None and st.in_flight >= 0:
                                st.in_flight = None
                now = time.monotonic()
                requests, queues = [], []
                with self._lock:
                    for q, st in mine.items():
                        if st.in_flight is None and st.retry_at <= now:
                            requests.append((PULL_MESSAGE, self._pull_header(q, st), b""))
                            queues.append(q)
                if requests:
                    sent_ms = time.time_ns() // 1_000_000
                    opaques = conn.submit(requests, now + self.timeout)
                    with self._lock:
                        for o, q in zip(opaques, queues):
                            mine[q].in_flight, mine[q].sent_ms = o, sent_ms
                            pending[o] = q
                if not pending:
                    time.sleep(0.05)
                    continue
                if not conn.readable(0.1):
                    continue
                resp = conn.read_response(time.monotonic() + self.timeout + self.suspend_ms / 1000)
            except RemotingError as e:
                log.warning("pulling from %s (%s) failed: %s; reconnecting", broker, addr, e)
                if conn is not None:
                    conn.close()
                conn = None
                time.sleep(self.retry_backoff_s)
                continue
            # Group commit sized by load: answers already here (other queues') are stored together,
            # so a busy topic goes in commits of up to every owned queue's pull, an idle one in one.
            answers = [(resp, pending.pop(resp.opaque, None))]
            try:
                while pending and len(answers) < _MAX_ANSWERS_PER_COMMIT and conn.readable(0):
                    more = conn.read_response(time.monotonic() + self.timeout)
                    answers.append((more, pending.pop(more.opaque, None)))
            except RemotingError as e:  # what was read is handled; the connection is made again
                log.warning("pulling from %s (%s) failed: %s; reconnecting", broker, addr, e)
                conn.close()
                conn = None
            self._handle_pulls([(q, r) for r, q in answers if q is not None])
        if conn is not None:
            conn.close()

    def _unframed(self, q: Queue, offset: int, err: MessageDecodeError) -> ReceivedMessage:
        """The unreadable rest of a pull body, as one message to park (its bytes, where, and why)."""
        return ReceivedMessage(self.topic, err.raw, "", "", f"{q[0]}:{q[1]}:{offset}", {}, q[1], offset, -1, 0, 0,
                               0, f"{err} (after {self.max_decode_tries} pulls)", q[0])

    def _pull_header(self, q: Queue, st: _QueueState) -> dict[str, str]:
        commit = st.offset > st.committed
        flags = _FLAG_SUSPEND | _FLAG_SUBSCRIPTION | (_FLAG_COMMIT_OFFSET if commit else 0)
        if commit:
            st.committed = st.offset
        return {"consumerGroup": self.group, "topic": self.topic, "queueId": str(q[1]),
                "queueOffset": str(st.offset), "maxMsgNums": str(self.pull_batch), "sysFlag": str(flags),
                "commitOffset": str(st.committed if commit else 0), "suspendTimeoutMillis": str(self.suspend_ms),
                "subscription": "*", "subVersion": "0", "expressionType": "TAG"}

    def _handle_pulls(self, answered: list[tuple[Queue, Response]]) -> None:
        """Hand the messages of every answer to the callback at once; commit or retry them together."""
        found: list[tuple[Queue, _QueueState, int, list[ReceivedMessage], bool]] = []
        budget = InflateBudget(self.max_commit_inflated_bytes)
        for q, resp in answered:
            got = self._read_pull(q, resp, budget)
            if got is not None:
                found.append((q, *got))
        if not found:
            return
        batch = [m for _, _, _, msgs, _ in found for m in msgs]
        try:
            accepted = self.on_batch(batch) if batch else True
        except Exception:
            log.exception("the ingest callback failed; the batch will be pulled again")
            accepted = False
        for q, st, next_offset, _, caught_up in found:
            if accepted:
                self.counters["batches"] += 1
                st.offset, st.decode_failures, st.last_consume_ms = next_offset, 0, int(time.time() * 1000)
                self._accepted_below(q, next_offset)
                if caught_up:
                    st.caught_up_ms = st.sent_ms  # the queue held nothing more when the pull was answered
            else:
                self.counters["refused"] += 1
                st.retry_at = time.monotonic() + self.retry_backoff_s
            st.in_flight = None

    def _read_pull(self, q: Queue, resp: Response,
                   budget: InflateBudget) -> tuple[_QueueState, int, list[ReceivedMessage], bool] | None:
        """A pull's answer: its messages to hand over (with the queue's state, next offset, and whether
        that reaches the end of the queue as it was when the pull was answered), or
        None once handled here (nothing new, offset moved, an error, a body to pull again)."""
        with self._lock:
            st = self._owned.get(q)
        if st is None or st.released:  # released meanwhile: the next owner pulls it
            return None
        if st.in_flight != resp.opaque:  # the queue was reset meanwhile: this answer is for the old offset
            return None
        st.last_pull_ms = int(time.time() * 1000)
        next_offset = int(resp.ext.get("nextBeginOffset", st.offset))
        if resp.code == SUCCESS:
            try:
                batch = decode_messages(resp.body, self.max_body_bytes, q[0], budget)
                st.decode_failures = 0
            except MessageDecodeError as e:
                st.decode_failures += 1
                if st.decode_failures < self.max_decode_tries:
                    log.error("cannot decode a pull of %s/%s at offset %d (try %d of %d): %s; pulling it again",
                              self.topic, q, st.offset, st.decode_failures, self.max_decode_tries, e)
                    st.in_flight, st.retry_at = None, time.monotonic() + self.retry_backoff_s
                    return None
                batch = [*e.decoded, self._unframed(q, st.offset + len(e.decoded), e)]
            undecodable = sum(1 for m in batch if m.undecodable)
            if undecodable:
                self.counters["undecodable"] += undecodable
                log.error("%d message(s) of %s/%s from offset %d cannot be read; they go on raw: %s", undecodable,
                          self.topic, q, st.offset, next(m.undecodable for m in batch if m.undecodable))
            self.counters["pulled"] += len(batch)
            caught_up = next_offset >= int(resp.ext.get("maxOffset", next_offset + 1))
            if budget.stopped:
                # the commit's inflate budget stopped reading: the rest comes with the next pull
                budget.stopped = False
                next_offset, caught_up = (batch[-1].queue_offset + 1 if batch else st.offset), False
            return st, next_offset, batch, caught_up
        if resp.code in (PULL_NOT_FOUND, PULL_RETRY_IMMEDIATELY):
            st.offset = max(st.offset, next_offset) if resp.code == PULL_NOT_FOUND else st.offset
            if resp.code == PULL_NOT_FOUND:
                st.caught_up_ms = st.sent_ms
                self._accepted_below(q, st.offset)
        elif resp.code == PULL_OFFSET_MOVED:
            # The offset is gone from the broker, or an operator reset the group on the broker's side:
            # go on where the broker says, and tell it so with the next pull (as the Java client does).
            log.warning("the broker moved %s/%s from offset %d to %d", self.topic, q, st.offset, next_offset)
            self.offsets_moved.append(f"{q[0]}:{q[1]} {st.offset} -> {next_offset}")
            st.offset, st.committed = next_offset, -1
        else:
            log.warning("pull of %s/%s answered %s: %s", self.topic, q, resp.code, resp.remark)
            st.retry_at = time.monotonic() + self.retry_backoff_s
        st.in_flight = None
        return None
