"""A consumer's pulling: one thread per broker keeps a long-polling pull in flight per owned queue.

Pulls are pipelined on one connection per broker and matched by opaque; the broker answers as
soon as messages arrive, or after `suspend_ms` with none (its hold service may take a few
seconds more). A pull still unanswered well past that, while nothing more arrives, was lost (a
half-open connection, a held pull the broker failed to answer): the connection is made again and
every queue of it pulled anew. Every answer already read when one arrives goes to the callback in
one batch (one store commit), the compressed bodies of the lot inflating under one budget. A
batch's offsets are committed (piggybacked on the next pull of each queue) only after the callback
accepted it; a refused batch is pulled again after `retry_backoff_s`. PULL_OFFSET_MOVED is followed
to where the broker says, and that offset is committed with the next pull (as the Java client does).
PULL_RETRY_IMMEDIATELY is followed to its nextBeginOffset too, after the pulls a gap gets (`_whole`);
one with no offset past the queue's is pulled again after `retry_backoff_s`, never at once.

With `linger_ms`, a queue whose answer emptied it (the broker's maxOffset reached), or left less
than one more answer after an answer cut by the count, is pulled again at the next multiple of that
period (`next_tick`). Under a steady stream the broker answers a long poll as soon as one message
arrives, so without it every pull, and every store commit, carries a message or two, and the pull's
fixed cost (a round trip, a commit) is paid per message (bench/RESULTS_HOTPATHS.md); and a queue
whose share of a tick just overflows one answer would be pulled again at once for the few left
over, in a commit of their own. On a common tick the queues of a broker are pulled in one write and
their answers, read within `_GATHER_S` of each other, go in one commit. A backlog (a full answer or
more left, or an answer cut by the broker's byte limit) still goes pull after pull, however few
messages each answer holds (large bodies, the commit's inflate budget).

Wire formats used here (apache/rocketmq, 5.x):
    PULL_MESSAGE (11) extFields: consumerGroup, topic, queueId, queueOffset, maxMsgNums, sysFlag
      (1 commit offset, 2 suspend, 4 subscription), commitOffset, suspendTimeoutMillis,
      subscription, subVersion, expressionType. Answers: 0 found (body: messages), 19 none new,
      20 retry now, 21 offset moved; extFields nextBeginOffset, minOffset, maxOffset.
    body: stored messages one after another (`codec.decode_messages`).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, cast

from forwarder.rocketmq._membership import Membership
from forwarder.rocketmq._pull_answer import _DECODE, Answer, BatchCallback, BodyReader, _Messages
from forwarder.rocketmq._queue_state import Queue, QueueState, QueueTable
from forwarder.rocketmq.compression import InflateBudget
from forwarder.rocketmq.connection import Connection
from forwarder.rocketmq.errors import (BatchesRefusedError, MessageDecodeError, ProtocolError, RemotingError,
                                       RequestTimeoutError)
from forwarder.rocketmq.message import ReceivedMessage
from forwarder.rocketmq.protocol import (PULL_MESSAGE, PULL_NOT_FOUND, PULL_OFFSET_MOVED, PULL_RETRY_IMMEDIATELY,
                                         SUCCESS, Reply, Request, Response, ext_int)
from forwarder.rocketmq.security import ClientSecurity

__all__ = ["Answer", "BatchCallback", "BodyReader", "PullSettings", "Puller"]

log = logging.getLogger("timewheel.pull")

_FLAG_COMMIT_OFFSET = 1
_FLAG_SUSPEND = 2
_FLAG_SUBSCRIPTION = 4
#: pull answers stored in one commit at most (each up to `pull_batch` messages)
_MAX_ANSWERS_PER_COMMIT = 32
#: with a linger, how long the answers of one tick's pulls are waited for once the first arrived
_GATHER_S = 0.001
#: pulls of one offset whose answer skips offsets below nextBeginOffset before the gap is taken as given
_GAP_PULLS = 2
#: how much later than its long poll and the request timeout a pull may still be answered: a broker
#: looks at the pulls it holds every 5 s, and a pull may wait up to 5 s in its queue before that
_LATE_ANSWER_S = 10.0


def _emptied(resp: Response, asked: int, pull_batch: int) -> bool:
    """Whether a pull's answer (to a pull from offset `asked`) left less than one more answer in its
    queue, a steady stream rather than a backlog: it reached the end, or it was cut by the count
    (`pull_batch`) and fewer than that many remain. One cut by the broker's byte limit (large
    bodies, a few to an answer) is a backlog however few remain."""
    ext = resp.ext
    try:
        end, left = int(ext.get("nextBeginOffset", 0)), int(ext.get("maxOffset", 0))
    except ValueError:  # a broker's odd answer: `_read_pull` says what is wrong with it
        return False
    left -= end
    return left <= 0 or (left < pull_batch and end - asked >= pull_batch)


def _queue_of(pending: dict[int, tuple[Queue, float]], opaque: int) -> Queue | None:
    """The queue the answered pull was sent for, taken out of `pending` (None: no pull waits for it)."""
    got = pending.pop(opaque, None)
    return None if got is None else got[0]


def next_tick(now: float, period: float) -> float:
    """The next multiple of `period` after `now` (monotonic seconds): the lingering queues of a
    broker are pulled again together, so their answers come back together and go in one commit."""
    tick = (now // period + 1) * period
    return tick if tick > now else tick + period  # `//` on floats may land a tick short

@dataclass(frozen=True)
class PullSettings:
    """How a consumer pulls: batch size, long-poll time, retries and the bounds on what it reads."""

    group: str
    topic: str
    pull_batch: int
    suspend_ms: int
    retry_backoff_s: float
    timeout: float
    max_body_bytes: int
    max_decode_tries: int
    #: compressed bodies of one commit inflate to at most this (plus one message) in all
    max_commit_inflated_bytes: int
    security: ClientSecurity | None
    #: a queue whose last answer emptied it waits this long before its next pull
    linger_ms: int = 0
    #: when the callback refused every batch holding a queue's messages for this long, the pull thread
    #: of its broker stops (fail-stop: `BatchesRefusedError`), rather than pulling them again for ever
    max_refused_s: float = 120.0


class Puller:
    """The pull threads of one consumer, one per broker it owns queues of; see the module docstring."""

    def __init__(self, settings: PullSettings, table: QueueTable, membership: Membership,
                 on_batch: Callable[[list[Any]], bool], answer: Callable[[Request], Reply | None],
                 counters: dict[str, int], reader: BodyReader | None = None) -> None:
        """`membership` says where brokers are and commits a queue given up; `answer` answers what a
        broker asks on a pull connection; `reader`: how bodies are read (then `on_batch` gets one
        `Answer` per pull answer; without one, every answer's messages in one list)."""
        self.reader = reader or _DECODE
        self._flat = reader is None
        self.settings = settings
        self.table = table
        self.membership = membership
        self.on_batch = on_batch
        self.answer = answer
        self.counters = counters
        self.running = threading.Event()
        self._threads: dict[str, threading.Thread] = {}
        #: broker -> the error that ended its pull thread (fail-stop: never started again)
        self.failures: dict[str, str] = {}
        #: queue -> since when (monotonic) the callback refused every batch holding its messages
        self._refused_since: dict[Queue, float] = {}

    def pull_from(self, broker: str) -> None:
        """Make sure a pull thread runs for `broker` (it ends once it owns nothing there); not for a
        broker whose pull thread failed: what it owns stays unread until the consumer is restarted."""
        if broker in self.failures:
            return
        t = self._threads.get(broker)
        if t is None or not t.is_alive():
            t = threading.Thread(target=self._pull_loop, args=(broker,), name=f"ingest-pull-{broker}", daemon=True)
            self._threads[broker] = t
            t.start()

    def thread_count(self) -> int:
        """How many pull threads were started and not yet joined."""
        return len(self._threads)

    def stop(self) -> None:
        """Stop every pull thread and wait for them."""
        self.running.clear()
        for t in list(self._threads.values()):
            t.join()
        self._threads.clear()

    def dead_threads(self) -> list[str]:
        """The pull threads that an unexpected error ended (each logged with its traceback)."""
        return [f"ingest-pull-{b}" for b in sorted(self.failures)]

    def thread_failures(self) -> dict[str, str]:
        """Of the threads `dead_threads` names, the error that ended each."""
        return {f"ingest-pull-{b}": e for b, e in self.failures.items()}

    def _pull_loop(self, broker: str) -> None:
        """`_pull` for `broker`, fail-stop: an error nothing here expected ends the thread for good
        (recorded in `failures`, which the consumer's `dead_threads` reports). What it had pulled and
        not stored is not committed, so the next start reads it again."""
        try:
            self._pull(broker)
        except Exception as e:
            self.failures[broker] = f"{type(e).__name__}: {e}"
            log.critical("the pull thread of broker %s died; nothing more is read from its queues until the "
                         "consumer is restarted (what it had not stored is read again then)", broker, exc_info=True)

    def _pull(self, broker: str) -> None:
        """Keep one pull in flight per owned queue of `broker`; hand each batch to the callback."""
        s, membership = self.settings, self.membership
        conn: Connection | None = None
        pending: dict[int, tuple[Queue, float]] = {}  # opaque -> (queue, when its answer is overdue)
        while self.running.is_set():
            mine = self.table.of_broker(broker)
            addr = membership.address(broker)
            for q, st in list(mine.items()):
                if st.released:  # nothing of it is being handled on this thread now: hand it over
                    membership.commit(q, st)
                    self.table.drop(q, st)
                    self._refused_since.pop(q, None)
                    del mine[q]
                    pending = {o: v for o, v in pending.items() if v[0] != q}
            if not mine or addr is None:
                break
            try:
                if conn is None or conn.closed:
                    conn = Connection(addr, s.timeout, s.security, self.answer)
                    pending.clear()
                    with self.table.lock:
                        for st in mine.values():
                            if st.in_flight is not None and st.in_flight >= 0:
                                st.in_flight = None
                now = time.monotonic()
                requests, queues = [], []
                with self.table.lock:
                    for q, st in mine.items():
                        if st.in_flight is None and st.retry_at <= now:
                            requests.append((PULL_MESSAGE, self._pull_header(q, st), b""))
                            queues.append(q)
                if requests:
                    sent_ms = time.time_ns() // 1_000_000
                    opaques = conn.submit(requests, now + s.timeout)
                    overdue = now + s.suspend_ms / 1000 + s.timeout + _LATE_ANSWER_S
                    with self.table.lock:
                        for o, q in zip(opaques, queues):
                            mine[q].in_flight, mine[q].sent_ms = o, sent_ms
                            pending[o] = q, overdue
                wait = self._next_pull_in(mine, now)
                if not pending:
                    time.sleep(min(0.05, wait))
                    continue
                if not conn.readable(min(0.1, wait)):
                    # Nothing more is coming and the oldest pull is overdue: its answer was lost (a
                    # half-open connection, a held pull the broker failed to answer), and nothing but
                    # a new connection pulls its queue again.
                    late = time.monotonic() - next(iter(pending.values()))[1]
                    if late > 0:
                        waited = late + s.suspend_ms / 1000 + s.timeout + _LATE_ANSWER_S
                        raise RequestTimeoutError(f"no answer to a pull sent {waited:.1f} s ago (a long poll of "
                                                  f"{s.suspend_ms} ms)")
                    continue
                resp = conn.read_response(time.monotonic() + s.timeout + s.suspend_ms / 1000)
            except RemotingError as e:
                log.warning("pulling from %s (%s) failed: %s; reconnecting", broker, addr, e)
                if conn is not None:
                    conn.close()
                conn = None
                time.sleep(s.retry_backoff_s)
                continue
            # Group commit sized by load: answers already here (other queues') are stored together,
            # so a busy topic goes in commits of up to every owned queue's pull, an idle one in one.
            answers = [(resp, _queue_of(pending, resp.opaque))]
            # With a linger, the queues pulled on one tick answer within a moment of each other:
            # a moment's wait puts them in one commit instead of a commit each. A backlog (an
            # answer that left a full answer or more in its queue) waits for nothing: what is
            # there goes now.
            gather = _GATHER_S if s.linger_ms and self._emptied(answers[0]) else 0.0
            try:
                while pending and len(answers) < _MAX_ANSWERS_PER_COMMIT and conn.readable(gather):
                    more = conn.read_response(time.monotonic() + s.timeout)
                    answers.append((more, _queue_of(pending, more.opaque)))
                    if gather and not self._emptied(answers[-1]):
                        gather = 0.0  # a backlog after all: what is here goes now
            except RemotingError as e:  # what was read is handled; the connection is made again
                log.warning("pulling from %s (%s) failed: %s; reconnecting", broker, addr, e)
                conn.close()
                conn = None
            self._handle_pulls([(q, r) for r, q in answers if q is not None])
        if conn is not None:
            conn.close()

    def _emptied(self, answer: tuple[Response, Queue | None]) -> bool:
        """`_emptied` for an answer and the queue it was pulled for (None: no longer pulled here)."""
        resp, q = answer
        st = self.table.get(q) if q is not None else None
        return st is not None and _emptied(resp, st.offset, self.settings.pull_batch)

    def _next_pull_in(self, mine: dict[Queue, QueueState], now: float) -> float:
        """Seconds until a queue not in flight may be pulled (a lingering one), at most 0.1."""
        wait = 0.1
        with self.table.lock:
            for st in mine.values():
                if st.in_flight is None and st.retry_at > now:
                    wait = min(wait, st.retry_at - now)
        return max(wait, 0.0)

    def _pull_header(self, q: Queue, st: QueueState) -> dict[str, str]:
        s = self.settings
        commit = st.take_commit()
        flags = _FLAG_SUSPEND | _FLAG_SUBSCRIPTION | (_FLAG_COMMIT_OFFSET if commit else 0)
        return {"consumerGroup": s.group, "topic": s.topic, "queueId": str(q[1]),
                "queueOffset": str(st.offset), "maxMsgNums": str(s.pull_batch), "sysFlag": str(flags),
                "commitOffset": str(st.committed if commit else 0), "suspendTimeoutMillis": str(s.suspend_ms),
                "subscription": "*", "subVersion": "0", "expressionType": "TAG"}

    def _handle_pulls(self, answered: list[tuple[Queue, Response]]) -> None:
        """Hand the messages of every answer to the callback at once; commit or retry them together."""
        found: list[tuple[Queue, QueueState, int, Answer, bool, bool]] = []
        budget = InflateBudget(self.settings.max_commit_inflated_bytes)
        for q, resp in answered:
            got = self._read_pull(q, resp, budget)
            if got is not None:
                found.append((q, *got))
        if not found:
            return
        batch: list[Any] = ([m for _, _, _, msgs, _, _ in found for m in cast(_Messages, msgs)] if self._flat
                            else [msgs for _, _, _, msgs, _, _ in found if len(msgs)])
        try:
            accepted = self.on_batch(batch) if batch else True
        except BatchesRefusedError:
            raise  # the callback knows no retry can succeed: fail-stop, nothing of the batch committed
        except Exception:
            log.exception("the ingest callback failed; the batch will be pulled again")
            accepted = False
        linger = self.settings.linger_ms / 1000
        for q, st, next_offset, _, caught_up, steady in found:
            if accepted:
                self.counters["batches"] += 1
                st.accepted(next_offset, caught_up)
                self.table.accepted_below(q, next_offset)
                if linger and steady:  # less than one more answer left: wait for company
                    st.retry_at = next_tick(time.monotonic(), linger)
            else:
                self.counters["refused"] += 1
                st.retry_after(self.settings.retry_backoff_s)
        self._count_refusal([q for q, *_ in found], accepted)

    def _count_refusal(self, queues: list[Queue], accepted: bool) -> None:
        """Note a batch of `queues` accepted or refused; raise `BatchesRefusedError` (after the batch
        is handed back: nothing of it committed) once every batch holding one queue's messages was
        refused for `max_refused_s` while pulling (a refusal while stopping is not counted)."""
        since = self._refused_since
        if accepted or not self.running.is_set():
            for q in queues:
                since.pop(q, None)
            return
        now = time.monotonic()
        first = min(since.setdefault(q, now) for q in queues)
        if now - first >= self.settings.max_refused_s:
            q = min(queues, key=lambda k: since[k])
            raise BatchesRefusedError(
                f"the ingest refused every batch of {self.settings.topic} queue {q[1]} on {q[0]} for "
                f"{now - first:.0f} s (max_refused_s {self.settings.max_refused_s:g}; the log says why each was "
                f"refused): pulling stopped, nothing refused was committed")

    def _read_pull(self, q: Queue, resp: Response,
                   budget: InflateBudget) -> tuple[QueueState, int, Answer, bool, bool] | None:
        """A pull's answer: its messages to hand over (with the queue's state, next offset, whether
        that reaches the end of the queue as it was when the pull was answered, and whether the
        queue may wait for the next tick: `_emptied`), or None once handled here (nothing new,
        offset moved, an error, a body to pull again)."""
        s = self.settings
        st = self.table.get(q)
        if st is None:  # released meanwhile: the next owner pulls it
            return None
        if st.in_flight != resp.opaque:  # the queue was reset meanwhile: this answer is for the old offset
            return None
        st.last_pull_ms = int(time.time() * 1000)
        try:
            next_offset = ext_int(resp, "nextBeginOffset", st.offset)
            max_offset = ext_int(resp, "maxOffset", next_offset + 1) if resp.code == SUCCESS else 0
        except ProtocolError as e:  # nothing of the answer is taken: the same pull goes again, a few times
            self.counters["bad_answers"] += 1
            st.decode_failures += 1
            if st.decode_failures >= s.max_decode_tries:  # no offset to move on to: fail-stop (not ready)
                raise ProtocolError(f"pull of {s.topic}/{q} at offset {st.offset}, {st.decode_failures} answers "
                                    f"in a row: {e}") from e
            log.warning("pull of %s/%s at offset %d: %s; pulling it again in %.1f s", s.topic, q, st.offset, e,
                        s.retry_backoff_s)
            st.retry_after(s.retry_backoff_s)
            return None
        if resp.code == SUCCESS:
            framed = True
            try:
                batch = self.reader.read(resp.body, s.max_body_bytes, q[0], budget)
                st.decode_failures = 0
            except MessageDecodeError as e:
                framed = False
                st.decode_failures += 1
                if st.decode_failures < s.max_decode_tries:
                    log.error("cannot decode a pull of %s/%s at offset %d (try %d of %d): %s; pulling it again",
                              s.topic, q, st.offset, st.decode_failures, s.max_decode_tries, e)
                    st.retry_after(s.retry_backoff_s)
                    return None
                batch = self.reader.wrap([*e.decoded, self._unframed(q, st.offset + len(e.decoded), e)], q[0])
            if framed and not budget.stopped and not self._whole(q, st, next_offset, len(batch)):
                return None
            unreadable = batch.unreadable()
            if unreadable:
                self.counters["undecodable"] += len(unreadable)
                log.error("%d message(s) of %s/%s from offset %d cannot be read; they go on raw: %s", len(unreadable),
                          s.topic, q, st.offset, unreadable[0])
            self.counters["pulled"] += len(batch)
            caught_up = next_offset >= max_offset
            steady = _emptied(resp, st.offset, s.pull_batch)  # caught up, or less than one more answer left
            if budget.stopped:
                # the commit's inflate budget stopped reading: the rest comes with the next pull
                budget.stopped = False
                next_offset, caught_up, steady = (batch.last_offset() + 1 if len(batch) else st.offset), False, False
            return st, next_offset, batch, caught_up, steady
        if resp.code == PULL_NOT_FOUND:
            st.offset = max(st.offset, next_offset)
            st.caught_up_ms = st.sent_ms
            self.table.accepted_below(q, st.offset)
        elif resp.code == PULL_RETRY_IMMEDIATELY and next_offset > st.offset:
            # Nothing readable below nextBeginOffset (as when a commit-log file is being removed): a gap
            # like a found answer's, pulled again before it is passed over (the Java client moves at once).
            if not self._whole(q, st, next_offset, 0):
                return None
            st.offset, st.gap_pulls, st.decode_failures = next_offset, 0, 0
        elif resp.code == PULL_OFFSET_MOVED:
            # The offset is gone from the broker, or an operator reset the group on the broker's side:
            # go on where the broker says, and tell it so with the next pull (as the Java client does).
            log.warning("the broker moved %s/%s from offset %d to %d", s.topic, q, st.offset, next_offset)
            self.table.offsets_moved.append(f"{q[0]}:{q[1]} {st.offset} -> {next_offset}")
            st.offset, st.committed = next_offset, -1
        else:  # a PULL_RETRY_IMMEDIATELY with nowhere to move to too: at once again, it might spin for ever
            log.warning("pull of %s/%s answered %s: %s", s.topic, q, resp.code, resp.remark)
            st.retry_at = time.monotonic() + s.retry_backoff_s
        st.in_flight = None
        return None

    def _whole(self, q: Queue, st: QueueState, next_offset: int, count: int) -> bool:
        """Whether a found answer's `count` messages (none in a PULL_RETRY_IMMEDIATELY) run from the
        queue's offset up to `next_offset` without a gap. With the subscription `*` no filter explains
        one: a broker counts in its next offset a message whose commit-log read came back empty (a file
        being rolled or removed). Such an answer is pulled again, `_GAP_PULLS` times, before the gap is
        taken as given: then it is logged, counted and reported with the offsets moved past (`offsets_moved`)."""
        gap = next_offset - st.offset - count
        if gap <= 0:
            return True
        s = self.settings
        self.counters["pull_gaps"] = self.counters.get("pull_gaps", 0) + 1
        if st.gap_pulls < _GAP_PULLS:
            st.gap_pulls += 1
            log.warning("a pull of %s/%s at offset %d answered %d message(s) with next offset %d: %d not returned; "
                        "pulling it again (try %d of %d)", s.topic, q, st.offset, count, next_offset, gap,
                        st.gap_pulls, _GAP_PULLS)
            st.retry_after(s.retry_backoff_s)
            return False
        if st.gap_pulls > _GAP_PULLS:  # reported already (its batch was refused and pulled again)
            return True
        st.gap_pulls += 1
        log.error("a pull of %s/%s at offset %d still answers %d message(s) with next offset %d after %d pulls: "
                  "%d offset(s) the broker does not return are passed over", s.topic, q, st.offset, count,
                  next_offset, _GAP_PULLS + 1, gap)
        self.table.offsets_moved.append(f"{q[0]}:{q[1]} {st.offset} -> {next_offset} ({gap} not returned)")
        return True

    def _unframed(self, q: Queue, offset: int, err: MessageDecodeError) -> ReceivedMessage:
        """The unreadable rest of a pull body, as one message to park (its bytes, where, and why)."""
        s = self.settings
        return ReceivedMessage(s.topic, err.raw, "", "", f"{q[0]}:{q[1]}:{offset}", {}, q[1], offset, -1, 0, 0,
                               0, f"{err} (after {s.max_decode_tries} pulls)", q[0])
