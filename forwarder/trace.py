"""RocketMQ's message trace for the engine's two hops, so `mqadmin queryMsgTraceById` and the
Dashboard show them beside the producer's and the consumer's.

With `[rocketmq] trace = true` the engine writes, in the format of RocketMQ's clients
(`TraceDataEncoder` in apache/rocketmq's client module: fields separated by CONTENT_SPLITOR, char 1,
records ended by FIELD_SPLITOR, char 2), to `trace_topic` (RMQ_SYS_TRACE_TOPIC by default; a broker
may need `traceTopicEnable=true` to create it):

- when it stores a delay message, a consume record under the engine's consumer group: `SubBefore`
  (timestamp, region, group, request id, message id, retry times 0, keys) and `SubAfter` (request
  id, message id, cost ms, success, keys, context code 0, timestamp, group);
- when it delivers it, a produce record under the engine's producer group: `Pub` (timestamp,
  region, group, target topic, message id, tags, keys, store host, body length, cost ms, message
  type 0 (normal), the broker's message id of the delivered copy, success).

Every record names the delay message by the id its producer got back (its UNIQ_KEY), so a trace
query on that id shows the three hops in line: the producer's Pub to the delay topic, the engine's
Sub, the engine's Pub to the target topic (whose record carries the delivered copy's broker id).
Trace messages carry those ids and the keys as their keys (the broker indexes them), up to
`_BATCH` records each, as RocketMQ's `AsyncTraceDispatcher` batches them.

Tracing never touches a message's path: records wait in a bounded queue and one thread sends them;
a full queue drops records and a failed send loses its batch, each counted (`dropped`, `failed`)
and logged, as RocketMQ's own clients do with their trace.
"""
from __future__ import annotations

import logging
import queue
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from forwarder.rocketmq import OutgoingMessage, RemotingError, RemotingProducer
from storage import Origin, RecordBytes, broker_message_ids, decode_keys
from timewheel.cancels import producer_id
from timewheel.message import Message, ScheduleFn, SendResults

__all__ = ["CONTENT", "FIELD", "TraceWriter", "TracingSink", "consume_record", "produce_record", "traced_schedule"]

log = logging.getLogger("timewheel.trace")
CONTENT = "\x01"  # TraceConstants.CONTENT_SPLITOR
FIELD = "\x02"  # TraceConstants.FIELD_SPLITOR
REGION = "DefaultRegion"  # what RocketMQ's clients write when no region is configured
_BATCH = 100  # records per trace message
_MAX_BODY = 128 * 1024  # bytes of records per trace message, as the clients' maxMsgSize
_QUEUE_BATCHES = 1000  # batches of records (one per send or stored batch) waiting before new ones are dropped


def _uniq(msg_id: str) -> str:
    """The id a producer got back for the message the engine stores as `<UNIQ_KEY>:<crc>`."""
    return producer_id(msg_id)


def _store_hosts(answers: np.ndarray) -> list[str]:
    """"ip:port" of each answer's store host (a send batch has one or a few: each formatted once)."""
    where = np.concatenate([answers["store_ip"].astype(np.int64), answers["store_port"].astype(np.int64)[:, None]],
                           axis=1)
    known: dict[tuple[int, ...], str] = {}
    return [known.get(w) or known.setdefault(w, "{}.{}.{}.{}:{}".format(*w)) for w in map(tuple, where.tolist())]


def consume_record(group: str, msg_id: str, keys: str, at_ms: int, cost_ms: int, request_id: str) -> str:
    """A SubBefore and a SubAfter record: the engine's consumer group took and stored the message."""
    c = CONTENT
    return (f"SubBefore{c}{at_ms}{c}{REGION}{c}{group}{c}{request_id}{c}{msg_id}{c}0{c}{keys}{FIELD}"
            f"SubAfter{c}{request_id}{c}{msg_id}{c}{cost_ms}{c}true{c}{keys}{c}0{c}{at_ms}{c}{group}{FIELD}")


def produce_record(group: str, topic: str, msg_id: str, tags: str, keys: str, store_host: str, body_len: int,
                   at_ms: int, cost_ms: int, offset_msg_id: str, success: bool = True) -> str:
    """A Pub record: the engine's producer group sent the message to `topic`."""
    c = CONTENT
    return (f"Pub{c}{at_ms}{c}{REGION}{c}{group}{c}{topic}{c}{msg_id}{c}{tags}{c}{keys}{c}{store_host}{c}"
            f"{body_len}{c}{cost_ms}{c}0{c}{offset_msg_id}{c}{'true' if success else 'false'}{FIELD}")


class TraceWriter:
    """Sends trace records to the trace topic from one background thread, in batches."""

    def __init__(self, producer: RemotingProducer, topic: str, consumer_group: str, producer_group: str) -> None:
        """Records go to `topic` through `producer` (the caller closes it); `consumer_group` and
        `producer_group` name the engine's two hops."""
        self.producer = producer
        self.topic = topic
        self.consumer_group = consumer_group
        self.producer_group = producer_group
        self.counters = {"records": 0, "sent": 0, "dropped": 0, "failed": 0}
        self._queue: queue.Queue[list[tuple[str, list[str]]] | None] = queue.Queue(_QUEUE_BATCHES)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="timewheel-trace", daemon=True)

    def start(self) -> "TraceWriter":
        """Start the sending thread."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Send what is queued, then stop the thread."""
        self._queue.put(None)
        self._thread.join()

    def counter_values(self) -> dict[str, int]:
        """A copy of the counters: records queued, sent, dropped (queue full), failed (send failed)."""
        with self._lock:
            return dict(self.counters)

    def consumed(self, messages: Sequence[Message], started_ms: int, now_ms: int) -> None:
        """Consume records for messages the engine stored (its consumer group's hop)."""
        request = uuid.uuid4().hex
        cost = max(0, now_ms - started_ms)
        out = []
        for m in messages:
            mid = _uniq(m.msg_id or "")
            out.append((consume_record(self.consumer_group, mid, " ".join(m.keys), now_ms, cost, request),
                        [mid, *m.keys]))
        self._add(out)

    def produced(self, records: RecordBytes, sent: Sequence[bool], answers: np.ndarray | None, started_ms: int,
                 now_ms: int) -> None:
        """Produce records for the stored records that were delivered (its producer group's hop)."""
        cost = max(0, now_ms - started_ms)
        topics = records.topics()
        # the fields as slices of the stored bytes, as the sink encodes them: no record decoded
        id_at, _, tags_at, keys_at, _, _ = (a.tolist() for a in records.field_starts())
        h = records.header
        id_len, tags_len, keys_len, body_len = (h[f].tolist() for f in ("id_len", "tags_len", "keys_len", "body_len"))
        mv = memoryview(records.data)
        rows = np.flatnonzero(np.asarray(sent, bool))
        offset_ids = broker_message_ids(answers[rows]) if answers is not None else [""] * len(rows)
        hosts = _store_hosts(answers[rows]) if answers is not None else [""] * len(rows)
        out = []
        for i, offset_id, host in zip(rows.tolist(), offset_ids, hosts):
            mid = _uniq(str(mv[id_at[i]:id_at[i] + id_len[i]], "utf-8"))
            keys = decode_keys(mv[keys_at[i]:keys_at[i] + keys_len[i]], keys_at[i])
            tags = str(mv[tags_at[i]:tags_at[i] + tags_len[i]], "utf-8")
            out.append((produce_record(self.producer_group, topics[i], mid, tags, " ".join(keys),
                                       host if offset_id else "", body_len[i], now_ms, cost, offset_id),
                        [mid, *keys]))
        self._add(out)

    def _add(self, records: list[tuple[str, list[str]]]) -> None:
        """Queue one batch's records (with the keys each is found by), or drop them when the queue is full."""
        if not records:
            return
        try:
            self._queue.put_nowait(records)
        except queue.Full:
            with self._lock:
                self.counters["dropped"] += len(records)
            return
        with self._lock:
            self.counters["records"] += len(records)

    def _run(self) -> None:
        stopping = False
        while not stopping:
            item = self._queue.get()
            batch: list[tuple[str, list[str]]] = []
            if item is None:
                stopping = True
            else:
                batch.extend(item)
            while not stopping:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stopping = True
                else:
                    batch.extend(more)
            for start in range(0, len(batch), _BATCH):
                part = batch[start:start + _BATCH]
                try:
                    self._send(part)
                except Exception:  # a trace is never worth its thread: count, log, go on with the next
                    log.exception("message trace: %d records not written to %s", len(part), self.topic)
                    with self._lock:
                        self.counters["failed"] += len(part)

    def _send(self, batch: list[tuple[str, list[str]]]) -> None:
        """Send records as trace messages of at most `_MAX_BODY` bytes each."""
        messages: list[OutgoingMessage] = []
        body: list[str] = []
        keys: dict[str, None] = {}
        size = 0
        for record, ks in batch:
            if body and size + len(record) > _MAX_BODY:
                messages.append(OutgoingMessage(self.topic, "".join(body).encode(), None, " ".join(keys)))
                body, keys, size = [], {}, 0
            body.append(record)
            keys.update(dict.fromkeys(k for k in ks if k))
            size += len(record)
        if body:
            messages.append(OutgoingMessage(self.topic, "".join(body).encode(), None, " ".join(keys)))
        try:
            outcomes = self.producer.send(messages)
        except RemotingError as e:
            outcomes = [e] * len(messages)
        failed = [o for o in outcomes if isinstance(o, RemotingError)]
        with self._lock:
            self.counters["sent"] += len(batch) if not failed else 0
            self.counters["failed"] += len(batch) if failed else 0
        if failed:
            log.warning("message trace: %d records not written to %s: %s", len(batch), self.topic, failed[0])


class TracingSink:
    """A Sink that writes a produce record for each message its inner sink delivered."""

    def __init__(self, inner: Any, writer: TraceWriter, now_ms: Callable[[], int]) -> None:
        """Wrap `inner` (a `RocketMQSink`): same sends, same answers, plus the trace."""
        self.inner = inner
        self.writer = writer
        self.now_ms = now_ms
        self.max_in_flight = int(getattr(inner, "max_in_flight", 1))
        self.linger_ms = int(getattr(inner, "linger_ms", 0))
        self.linger_max_ms = int(getattr(inner, "linger_max_ms", self.linger_ms))

    def send_records(self, records: RecordBytes, extra: Any = None, fence: Any = None) -> list[bool]:
        """Send through the inner sink; trace what it delivered."""
        started = self.now_ms()
        results = self.inner.send_records(records, extra, fence)
        answers = results.answers if isinstance(results, SendResults) else None
        self.writer.produced(records, results, answers, started, self.now_ms())
        return results

    def send_batch(self, messages: Sequence[Message]) -> list[bool]:
        """Send through the inner sink (messages that are not stored records are not traced)."""
        return self.inner.send_batch(messages)

    def dead_letter(self, messages: Sequence[Message], reason: str) -> None:
        """The inner sink's dead-letter path."""
        self.inner.dead_letter(messages, reason)


def traced_schedule(schedule: ScheduleFn, writer: TraceWriter, now_ms: Callable[[], int]) -> ScheduleFn:
    """`schedule` that writes a consume record for each message of a batch once it is stored."""
    def run(messages: Sequence[Message], origins: Sequence[Origin] | None = None) -> list[str]:
        started = now_ms()
        ids = schedule(messages, origins)
        writer.consumed(messages, started, now_ms())
        return ids
    return run
