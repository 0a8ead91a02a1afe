"""A consumer's group membership: heartbeats, the group's members, the split of the topic's queues.

As RocketMQ's own clients do: a heartbeat to every broker of the topic every
`rebalance_interval_s` registers this client in the group; then the group's members
(GET_CONSUMER_LIST_BY_GROUP) and the topic's read queues are sorted and split evenly
(AllocateMessageQueueAveragely), so members agree without talking to each other. A member that
stops unregisters; one that dies is dropped by the broker when its connection closes. Queues move
at the next rebalance of each member; a queue given up is committed where it was accepted up to.

Wire formats used here (apache/rocketmq, 5.x):
    QUERY_CONSUMER_OFFSET (14) / UPDATE_CONSUMER_OFFSET (15): consumerGroup, topic, queueId
      [, commitOffset]; 22 = no offset stored. GET_MIN_OFFSET (31): topic, queueId -> offset.
    HEART_BEAT (34): body {"clientID", "producerDataSet": [], "consumerDataSet": [...]}.
    UNREGISTER_CLIENT (35): clientID, consumerGroup. GET_CONSUMER_LIST_BY_GROUP (38):
      consumerGroup -> body {"consumerIdList": [...]}.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from typing import Callable, Sequence

from forwarder.rocketmq._queue_state import Queue, QueueState, QueueTable
from forwarder.rocketmq.connection import Connection
from forwarder.rocketmq.errors import ProtocolError, RemotingError
from forwarder.rocketmq.namesrv import NameServerClient, parse_route
from forwarder.rocketmq.protocol import (GET_CONSUMER_LIST_BY_GROUP, GET_MIN_OFFSET, HEART_BEAT, QUERY_CONSUMER_OFFSET,
                                         QUERY_NOT_FOUND, SUCCESS, UNREGISTER_CLIENT, UPDATE_CONSUMER_OFFSET, Reply,
                                         Request, Response, error_for_code, ext_int)
from forwarder.rocketmq.security import ClientSecurity

__all__ = ["Membership", "allocate_averagely"]

log = logging.getLogger("timewheel.pull")

#: how often the connections the broker may ask this member something on are looked at: what it asks
#: (members changed, mqadmin's consumerStatus) waits at most this long, against the seconds a caller
#: waits; 0.05 made an idle engine's rebalance thread wake 21 times a second (2 ms of CPU a second)
_SERVE_INTERVAL_S = 0.2


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


class Membership:
    """One client's place in a consumer group on one topic: which queues of `table` it owns."""

    def __init__(self, namesrv: NameServerClient, group: str, topic: str, client_id: str, table: QueueTable, *,
                 answer: Callable[[Request], Reply | None], pull_from: Callable[[str], None],
                 counters: dict[str, int], rebalance_interval_s: float, timeout: float,
                 security: ClientSecurity | None, queue_filter: Callable[[Queue], bool] | None) -> None:
        """`answer` answers what brokers ask on the control connections; `pull_from(broker)` makes sure
        a pull thread runs for a broker this member owns (or released) queues of."""
        self.namesrv = namesrv
        self.group = group
        self.topic = topic
        self.client_id = client_id
        self.table = table
        self.answer = answer
        self.pull_from = pull_from
        self.counters = counters
        self.rebalance_interval_s = rebalance_interval_s
        self.timeout = timeout
        self.security = security
        self.queue_filter = queue_filter
        #: set when the broker says the members changed: rebalance now, not at the next round
        self.rebalance_now = threading.Event()
        #: a replica's own start offsets (`broker:queue id` -> offset; set before start): a queue it
        #: names starts there, any other at its earliest retained offset, whatever the group committed
        self.start_offsets: dict[str, int] | None = None
        #: the error that ended the rebalance thread (fail-stop), None while it runs
        self.failure: str | None = None
        self._lock = threading.Lock()  # the broker addresses and control connections
        self._brokers: dict[str, str] = {}  # broker name -> master address
        self._control: dict[str, Connection] = {}  # broker address -> connection for control requests

    def address(self, broker: str) -> str | None:
        """The master address of a broker of the topic, as the last route said (None: not in it)."""
        with self._lock:
            return self._brokers.get(broker)

    def serve_loop(self, stopping: threading.Event) -> None:
        """Until `stopping`, rebalance every `rebalance_interval_s` (at once when the broker says the
        members changed), and answer what the broker asks on the control connections in between.

        Fail-stop: a fault nobody expected ends the loop (kept in `failure`, logged with its
        traceback); the consumer's `dead_threads` reports the thread, so its owner is not ready."""
        try:
            self._serve(stopping)
        except Exception as e:
            self.failure = f"{type(e).__name__}: {e}"
            log.critical("the rebalance thread of %s died; the group's changes are followed no more until the "
                         "consumer is restarted", self.group, exc_info=True)

    def _serve(self, stopping: threading.Event) -> None:
        next_at = time.monotonic() + self.rebalance_interval_s
        while not stopping.wait(_SERVE_INTERVAL_S):
            with self._lock:
                control = list(self._control.values())
            for conn in control:
                conn.serve_requests()
            if not self.rebalance_now.is_set() and time.monotonic() < next_at:
                continue
            self.rebalance_now.clear()
            next_at = time.monotonic() + self.rebalance_interval_s
            try:
                self.rebalance()
            except RemotingError as e:  # a NameServer or broker away, an odd answer: the next round tries again
                log.warning("rebalance of %s failed: %s; trying again in %ss", self.group, e, self.rebalance_interval_s)
            # Anything else is a fault nobody expected: it ends this thread (fail-stop), which the
            # consumer's `dead_threads` reports (its owner is then not ready), rather than being
            # logged every round while the group goes unfollowed.

    def rebalance(self) -> None:
        """Heartbeat, take this member's share of the queues and release the rest."""
        queues = self._read_queues()
        self._heartbeat()
        mine = set(allocate_averagely(queues, self.members(), self.client_id))
        released, added = self.table.changes(mine)
        for q in sorted(added):
            self.table.add(q, self._start_offset(q))
        self.table.release(released)  # each one's pull thread commits what it accepted, then drops it
        if released or added:
            self.counters["rebalances"] += 1
            log.info("group %s: now consuming %d queue(s) of %s (+%d -%d)", self.group, len(mine), self.topic,
                     len(added), len(released))
        for name in sorted({q[0] for q in mine} | {q[0] for q in released}):
            self.pull_from(name)

    def members(self) -> list[str]:
        """The group's members as the broker lists them now (client ids)."""
        with self._lock:
            addrs = sorted(set(self._brokers.values()))
        for addr in addrs:
            resp = self.request(addr, GET_CONSUMER_LIST_BY_GROUP, {"consumerGroup": self.group})
            try:
                ids = json.loads(resp.body).get("consumerIdList") or []
                if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
                    raise ValueError(f"consumerIdList is {ids!r}, not a list of client ids")
                return list(ids)
            except (ValueError, AttributeError) as e:  # not JSON, not an object, not ids
                raise ProtocolError(f"consumer list of {self.group} from {addr} is not one: {e}") from e
        return []

    def commit(self, q: Queue, st: QueueState) -> None:
        """Tell the broker the offset accepted up to (a queue given up, or the consumer stopping)."""
        if st.offset <= st.committed:
            return
        with self._lock:
            addr = self._brokers.get(q[0])
        if addr is None:  # the broker left the route (killed, taken out): no one to tell, as a refused commit
            log.warning("could not commit offset %d of %s/%s: broker %s is no longer in the route", st.offset,
                        self.topic, q, q[0])
            return
        try:
            self.request(addr, UPDATE_CONSUMER_OFFSET,
                         {"consumerGroup": self.group, "topic": self.topic, "queueId": str(q[1]),
                          "commitOffset": str(st.offset)})
            st.committed = st.offset
        except RemotingError as e:  # the next owner starts earlier: duplicates, never loss
            log.warning("could not commit offset %d of %s/%s: %s", st.offset, self.topic, q, e)

    def leave(self) -> None:
        """Unregister from the group on every broker (others take the queues over), close connections."""
        with self._lock:
            addrs = set(self._brokers.values())
        for addr in addrs:
            try:
                self.request(addr, UNREGISTER_CLIENT, {"clientID": self.client_id, "consumerGroup": self.group})
            except RemotingError as e:
                log.warning("could not leave group %s on %s: %s", self.group, addr, e)
        with self._lock:
            control, self._control = list(self._control.values()), {}
        for c in control:
            c.close()

    def request(self, addr: str, code: int, ext: dict[str, str], body: bytes = b"", *,
                ok: tuple[int, ...] = (SUCCESS,)) -> Response:
        """One request on the control connection to `addr`; raises unless its answer is one of `ok`."""
        with self._lock:
            conn = self._control.get(addr)
            if conn is None or not conn.alive():
                conn = self._control[addr] = Connection(addr, self.timeout, self.security, self.answer)
        resp = conn.request(code, ext, body, time.monotonic() + self.timeout)
        if resp.code not in ok:
            raise error_for_code(resp.code, resp.remark, f"broker {addr} (request {code})")
        return resp

    def _read_queues(self) -> list[Queue]:
        data = self.namesrv.route_document(self.topic)
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
        with self._lock:
            addrs = set(self._brokers.values())
        for addr in addrs:
            self.request(addr, HEART_BEAT, {}, body)

    def _start_offset(self, q: Queue) -> int:
        with self._lock:
            addr = self._brokers[q[0]]
        own = self.start_offsets.get(f"{q[0]}:{q[1]}") if self.start_offsets is not None else None
        if own is not None:
            return own
        ext = {"consumerGroup": self.group, "topic": self.topic, "queueId": str(q[1])}
        resp = self.request(addr, QUERY_CONSUMER_OFFSET, ext, ok=(SUCCESS, QUERY_NOT_FOUND))
        if resp.code == SUCCESS and ext_int(resp, "offset", -1) >= 0 and self.start_offsets is None:
            return ext_int(resp, "offset", -1)
        resp = self.request(addr, GET_MIN_OFFSET, {"topic": self.topic, "queueId": str(q[1])})
        return ext_int(resp, "offset", 0)
