"""Ingest lag per queue of the delay topic: what the broker holds that the engine has not taken.

Lag is RocketMQ's own measure (its admin tool's consumerProgress "diff"): the queue's max offset
minus the consumer group's committed offset. Both are asked from each broker master over the
remoting protocol, one pipelined batch of requests per broker:

    GET_MAX_OFFSET (30)         extFields topic, queueId            -> extFields offset
    QUERY_CONSUMER_OFFSET (14)  extFields consumerGroup, topic, ... -> extFields offset, or 22 (none yet)
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from forwarder.config import RocketMQConfig
from forwarder.pull_consumer import QUERY_CONSUMER_OFFSET, QUERY_NOT_FOUND
from forwarder.remoting import SUCCESS, Connection, RemotingError, RemotingProducer, Response, TopicRoute
from timewheel.errors import TimewheelError

GET_MAX_OFFSET = 30


@dataclass(frozen=True)
class QueueLag:
    """One queue of the delay topic: broker's max offset, the group's committed offset, the difference."""

    broker: str
    queue: int
    max_offset: int
    committed: int  # -1: the group has committed nothing on this queue yet
    lag: int

    def as_dict(self) -> dict[str, object]:
        """Plain dict for JSON."""
        return asdict(self)


class IngestLagError(TimewheelError):
    """The brokers could not be asked; the message says which and why."""


def _offset(answer: Response | RemotingError, what: str, addr: str) -> int:
    if isinstance(answer, RemotingError):
        raise IngestLagError(f"asking {addr} for the {what} failed: {answer}") from answer
    if answer.code == QUERY_NOT_FOUND:
        return -1
    if answer.code != SUCCESS:
        raise IngestLagError(f"{addr} refused the {what} request: code {answer.code} {answer.remark or ''}")
    return int(answer.ext.get("offset", -1))


def ingest_lag(cfg: RocketMQConfig, timeout_s: float = 3.0) -> list[QueueLag]:
    """The lag of every readable queue of the delay topic for the engine's consumer group."""
    routes = RemotingProducer(cfg.namesrv, cfg.consumer_group, timeout_ms=int(timeout_s * 1000))
    try:
        doc = routes.route_document(cfg.delay_topic)
    except RemotingError as e:
        raise IngestLagError(f"cannot read the route of {cfg.delay_topic} from {cfg.namesrv}: {e}") from e
    finally:
        routes.close()
    if doc is None:
        return []
    route = TopicRoute.parse(cfg.delay_topic, doc, time.monotonic(), readable=True)
    out: list[QueueLag] = []
    for broker, addr in sorted(route.brokers.items()):
        queues = [q for b, q in route.queues if b == broker]
        requests: list[tuple[int, dict[str, str], bytes]] = []
        for q in queues:
            ext = {"topic": cfg.delay_topic, "queueId": str(q)}
            requests += [(GET_MAX_OFFSET, ext, b""), (QUERY_CONSUMER_OFFSET, {**ext, "consumerGroup":
                                                                              cfg.consumer_group}, b"")]
        deadline = time.monotonic() + timeout_s
        try:
            conn = Connection(addr, timeout_s)
        except RemotingError as e:
            raise IngestLagError(f"cannot reach broker {broker} at {addr}: {e}") from e
        try:
            with conn.lock:
                opaques = conn.submit(requests, deadline)
                answers = conn.collect(opaques, deadline)
        except RemotingError as e:
            raise IngestLagError(f"asking broker {broker} at {addr} for offsets failed: {e}") from e
        finally:
            conn.close()
        for i, q in enumerate(queues):
            top = _offset(answers[opaques[2 * i]], "max offset", addr)
            committed = _offset(answers[opaques[2 * i + 1]], "consumer offset", addr)
            out.append(QueueLag(broker, q, top, committed, max(0, top - max(committed, 0))))
    return out
