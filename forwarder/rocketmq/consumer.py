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

The parts, each with one job: `_membership` (heartbeats, the group's members, the split of the
queues, giving queues up), `_puller` (the pull threads: requests, answers, the callback, commits
and retries), `_queue_state` (the one owner of each queue's offsets). Each names its wire formats.

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

import logging
import os
import socket
import threading
import time
import uuid
from typing import Any, Callable

from forwarder.rocketmq._membership import Membership, allocate_averagely
from forwarder.rocketmq._puller import Answer, BatchCallback, BodyReader, PullSettings, Puller
from forwarder.rocketmq._queue_state import Queue, QueueTable
from forwarder.rocketmq.codec import BROKER_MAX_MESSAGE_BYTES
from forwarder.rocketmq.consumer_status import consumer_status_body, parse_reset_offsets, running_info_body
from forwarder.rocketmq.namesrv import NameServerClient
from forwarder.rocketmq.protocol import (GET_CONSUMER_RUNNING_INFO, GET_CONSUMER_STATUS_FROM_CLIENT,
                                         NOTIFY_CONSUMER_IDS_CHANGED, REQUEST_CODE_NOT_SUPPORTED,
                                         RESET_CONSUMER_CLIENT_OFFSET, SUCCESS, SYSTEM_ERROR, Reply, Request)
from forwarder.rocketmq.security import ClientSecurity

__all__ = ["Answer", "BatchCallback", "BodyReader", "Queue", "RemotingPullConsumer", "allocate_averagely"]

log = logging.getLogger("timewheel.pull")


class RemotingPullConsumer:
    """One member of a clustering consumer group on one topic; see the module docstring."""

    def __init__(self, namesrv: str, group: str, topic: str, on_batch: BatchCallback | Callable[[list[Any]], bool], *,
                 pull_batch: int = 32, suspend_ms: int = 1000, rebalance_interval_s: float = 2.0,
                 retry_backoff_s: float = 1.0, timeout_ms: int = 3000, client_id: str | None = None,
                 max_body_bytes: int = BROKER_MAX_MESSAGE_BYTES, max_decode_tries: int = 3,
                 max_commit_inflated_bytes: int = 64 << 20,
                 security: ClientSecurity | None = None,
                 queue_filter: Callable[[Queue], bool] | None = None,
                 reader: BodyReader | None = None, pull_linger_ms: int = 0, max_refused_s: float = 120.0) -> None:
        """Configure (nothing connects until start()).

        A pull body that cannot be framed is pulled again up to `max_decode_tries` times; then its
        unreadable rest goes to `on_batch` as one `undecodable` message and the queue moves on.
        `queue_filter`: only queues it accepts are shared out in the group (a replica's shard).
        `reader`: how pull answers' bodies are read; `on_batch` then gets one `Answer` per pull answer.
        `pull_linger_ms`: a queue whose answer emptied it is pulled again no sooner than this.
        `max_refused_s`: when `on_batch` refused every batch holding a queue's messages for this long,
        that broker's pull thread stops (`BatchesRefusedError`, reported by `dead_threads`).
        """
        self.group = group
        self.topic = topic
        self.pull_batch = pull_batch
        self.client_id = client_id or f"{socket.gethostname()}@{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.counters = {"pulled": 0, "batches": 0, "refused": 0, "rebalances": 0, "undecodable": 0,
                         "offset_resets": 0, "bad_answers": 0, "pull_gaps": 0}
        timeout = timeout_ms / 1000
        self._namesrv = NameServerClient(namesrv, timeout, security)
        self._queues = QueueTable()
        self._membership = Membership(self._namesrv, group, topic, self.client_id, self._queues, answer=self.answer,
                                      pull_from=lambda broker: self._puller.pull_from(broker),
                                      counters=self.counters, rebalance_interval_s=rebalance_interval_s,
                                      timeout=timeout, security=security, queue_filter=queue_filter)
        settings = PullSettings(group, topic, pull_batch, suspend_ms, retry_backoff_s, timeout, max_body_bytes,
                                max_decode_tries, max_commit_inflated_bytes, security, pull_linger_ms, max_refused_s)
        self._puller = Puller(settings, self._queues, self._membership, on_batch, self.answer, self.counters, reader)
        self._stopping = threading.Event()
        self._rebalancer: threading.Thread | None = None
        self._started_ms = 0

    # -- lifecycle --

    def start(self) -> None:
        """Join the group, take this member's queues and start pulling."""
        self._puller.running.set()
        self._stopping.clear()
        self._started_ms = int(time.time() * 1000)
        self._membership.rebalance()
        self._rebalancer = threading.Thread(target=self._membership.serve_loop, args=(self._stopping,),
                                            name="ingest-rebalance", daemon=True)
        self._rebalancer.start()

    def stop(self) -> None:
        """Stop pulling, commit what was accepted, and leave the group (others take the queues over)."""
        self._stopping.set()
        if self._rebalancer is not None:
            self._rebalancer.join()
        self._puller.stop()
        for q, st in self._queues.take_all().items():
            self._membership.commit(q, st)
        self._membership.leave()
        self._namesrv.close()

    def dead_threads(self) -> list[str]:
        """The consumer's threads that an error ended while it runs (a pull thread, the rebalancer):
        the queues they served are read no more, so its owner reports not ready and restarts it."""
        dead = self._puller.dead_threads()
        t = self._rebalancer
        if t is not None and not t.is_alive() and not self._stopping.is_set():
            dead.append(t.name)
        return dead

    def thread_failures(self) -> dict[str, str]:
        """Of the threads `dead_threads` names, the error that ended each."""
        failures = self._puller.thread_failures()
        t = self._rebalancer
        if t is not None and self._membership.failure is not None:
            failures[t.name] = self._membership.failure
        return failures

    def owned(self) -> list[Queue]:
        """The queues this member consumes now."""
        return self._queues.owned()

    @property
    def start_offsets(self) -> dict[str, int] | None:
        """A replica's own start offsets (`broker:queue id` -> offset; set before start()): a queue it
        names starts there, any other at its earliest retained offset, whatever the group committed."""
        return self._membership.start_offsets

    @start_offsets.setter
    def start_offsets(self, offsets: dict[str, int] | None) -> None:
        self._membership.start_offsets = offsets

    @property
    def offsets_moved(self) -> list[str]:
        """Every PULL_OFFSET_MOVED answer since start, as "<broker>:<queue id> <from> -> <to>": gaps."""
        return self._queues.offsets_moved

    def caught_up_ms(self) -> int | None:
        """Wall-clock ms before which every message stored in every owned queue was accepted (None: owns
        none): the earliest of the queues' last pulls that found nothing more to read."""
        return self._queues.caught_up_ms()

    def stored_offsets(self) -> dict[str, int]:
        """Per queue (`broker:queue id`), the offset below which every message was accepted by the
        callback, since this member started from where it started (replica sets publish it)."""
        return self._queues.stored_offsets()

    def members(self) -> list[str]:
        """The group's members as the broker lists them now (client ids)."""
        return self._membership.members()

    # -- what the broker asks --

    def answer(self, req: Request) -> Reply | None:
        """Answer a request a broker sent this member (see the module docstring); None: no answer."""
        if req.code == NOTIFY_CONSUMER_IDS_CHANGED:
            self._membership.rebalance_now.set()
            return None
        if req.code == RESET_CONSUMER_CLIENT_OFFSET:
            if req.ext.get("group") == self.group and req.ext.get("topic") == self.topic:
                self.reset_offsets({(broker, qid): offset
                                    for (topic, broker, qid), offset in parse_reset_offsets(req.body).items()
                                    if topic == self.topic})
            return None
        if req.code == GET_CONSUMER_STATUS_FROM_CLIENT:
            mine = req.ext.get("group") == self.group and req.ext.get("topic") == self.topic
            return SUCCESS, None, consumer_status_body(self._queues.reports(self.topic) if mine else [])
        if req.code == GET_CONSUMER_RUNNING_INFO:
            if req.ext.get("consumerGroup") != self.group:
                group = req.ext.get("consumerGroup")
                return SYSTEM_ERROR, f"The Consumer Group <{group}> not exist in this consumer", b""
            return SUCCESS, None, running_info_body(self._properties(), self.topic, self._queues.reports(self.topic),
                                                    self.counters)
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
        moved = self._queues.reset(offsets)
        if moved:
            self.counters["offset_resets"] += moved
            log.warning("group %s: %d queue(s) of %s reset by the broker: %s", self.group, moved, self.topic,
                        {f"{q[0]}:{q[1]}": o for q, o in sorted(offsets.items())})

    def _properties(self) -> dict[str, str]:
        return {"PROP_NAMESERVER_ADDR": ";".join(self._namesrv.addrs), "PROP_CONSUME_TYPE": "CONSUME_PASSIVELY",
                "PROP_CONSUMEORDERLY": "false", "PROP_THREADPOOL_CORE_SIZE": str(max(self._puller.thread_count(), 1)),
                "PROP_CLIENT_VERSION": "timewheel remoting client", "PROP_CONSUMER_START_TIMESTAMP":
                str(self._started_ms), "consumerGroup": self.group, "messageModel": "CLUSTERING",
                "consumeFromWhere": "CONSUME_FROM_FIRST_OFFSET", "pullBatchSize": str(self.pull_batch),
                "clientId": self.client_id}
