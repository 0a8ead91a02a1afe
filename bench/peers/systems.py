"""One adapter per system under test, all with the same small interface (`System`).

An adapter starts what the system needs beyond the shared servers (consumers, pollers, the
timewheel process), sends workload messages the way a producer of that system would, and reports
each arrival at a consumer to the harness's current `Recorder` as `(id, wanted due ms)`. For the
restart measurement it stops and starts the system's own server with its pending messages.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np

from bench.peers.common import (BenchMessage, Deliver, Recorder, dir_allocated_bytes, free_port, not_a_checkout,
                                now_ms, remove_tree, terminate, tree_rss, wait_until)
from bench.peers.heap_engine import HeapEngine
from bench.peers.servers import PostgresServer, RedisServer
from forwarder import LocalRocketMQ
from forwarder._rmq_native import LogLevel, NativeProducer, NativePushConsumer
from forwarder.rocketmq import OutgoingMessage, ReceivedMessage
from tests.polling import admin_ready

DAY_MS = 86_400_000
#: RocketMQ's delay levels (messageDelayLevel default), level n at index n-1, in ms.
DELAY_LEVELS_MS = tuple(s * 1000 for s in (1, 5, 10, 30, 60, 120, 180, 240, 300, 360, 420, 480, 540, 600, 1200, 1800,
                                           3600, 7200))
#: RocketMQ 5's timerMaxDelaySec default: timer messages due further out are refused.
TIMER_MAX_DELAY_MS = 3 * DAY_MS


def delay_level(delay_ms: int) -> int:
    """The smallest delay level (1..18) whose delay is at least `delay_ms` (18 if none is)."""
    for level, ms in enumerate(DELAY_LEVELS_MS, start=1):
        if ms >= delay_ms:
            return level
    return len(DELAY_LEVELS_MS)


class Sink:
    """Forwards arrivals to whichever Recorder the current phase installed."""

    def __init__(self) -> None:
        """No recorder yet: arrivals are dropped."""
        self.current: Recorder | None = None

    def __call__(self, msg_id: int, due_ms: float) -> None:
        """Record one arrival."""
        rec = self.current
        if rec is not None:
            rec.record(msg_id, due_ms)


@dataclass
class MemorySample:
    """What a system holds at one moment: process RSS, server-reported memory, disk (allocated)."""

    rss: int
    disk: int
    server: int | None = None
    extra: dict[str, float] = field(default_factory=dict)


class System:
    """The interface the workloads drive; each peer overrides what differs."""

    name = "system"
    #: How far out the horizon workload may schedule (None: as far as asked).
    max_delay_ms: int | None = None
    #: Probes for the restart are due this long after they are sent: longer than a stop takes.
    probe_delay_ms = 5_000
    #: Extra wait for arrivals beyond the due time (delay-level rounding).
    extra_wait_s = 0.0
    #: Horizon messages this system gets (None: the workload's count).
    horizon_count: int | None = None
    #: The workloads this system runs, in order (see `bench.peers.runner.PHASES`).
    phases: tuple[str, ...] = ("steady", "burst", "horizon")

    def __init__(self, deliver: Deliver, work: Path) -> None:
        """`deliver` is called on each arrival; `work` is a scratch directory for this system."""
        self.deliver = deliver
        self.work = work
        self.notes: list[str] = []

    def open(self) -> None:
        """Start the consumer side and whatever the system runs beyond the shared servers."""

    def paced_topics(self) -> tuple[str, str | None]:
        """(topic, delay target) for RocketMQ's Java producer at the high steady rate: the target is None
        for plain messages. The topic read (the target, else the topic) is one only RocketMQ's Java consumer
        reads, not the harness's Python consumer. Only the systems with a `steady_high` phase have them."""
        raise NotImplementedError(f"{self.name} has no high-rate steady phase")

    def send(self, msgs: Sequence[BenchMessage]) -> int:
        """Send messages as a producer of this system would; return how many were accepted."""
        raise NotImplementedError

    def wait_stored(self, n: int, timeout: float) -> tuple[int, float]:
        """Wait until `n` accepted messages are stored by the system itself (default: ack = stored);
        return how many were, and the `perf_counter` time the last of them was."""
        return n, time.perf_counter()

    def process_pids(self) -> list[int]:
        """Processes doing the system's work outside the harness (their CPU time is recorded)."""
        return []

    def memory(self) -> MemorySample:
        """Sample memory and disk."""
        raise NotImplementedError

    def prefill(self, ids: np.ndarray, dues: np.ndarray, body: bytes) -> dict[str, object]:
        """Load the horizon's pending messages by the system's fastest path (default: send)."""
        for start in range(0, len(ids), 500):
            self.send([BenchMessage(int(i), int(d), body) for i, d in zip(ids[start:start + 500], dues[start:start + 500])])
        return {"path": "producer sends"}

    def memory_figures(self, before: MemorySample, loaded: MemorySample, restarted: MemorySample,
                       pending: int) -> dict[str, object]:
        """Bytes per pending message: RSS growth by default; disk growth beside it."""
        return {"bytes_per_pending": round((loaded.rss - before.rss) / pending, 1),
                "disk_per_pending": round((loaded.disk - before.disk) / pending, 1),
                "how": "RSS growth of the server process / pending"}

    def diagnostics(self) -> dict[str, object]:
        """The system's own counters after a phase (kept in the JSON), if it has any."""
        return {}

    def stop_for_restart(self) -> None:
        """Stop the system with its pending messages (gracefully)."""
        raise NotImplementedError

    def start_after_stop(self) -> int | None:
        """Start it again; return the epoch ns of the first delivery if the system reports it itself."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop everything this adapter started."""


# -- RocketMQ-based systems ---------------------------------------------------------------------


def _on_rocketmq(deliver: Deliver, foreign: list[int]):  # type: ignore[no-untyped-def]
    """A consume callback reading the bench's id and wanted due time from the message properties;
    messages without them are counted in `foreign[0]`."""

    def on_message(msg: ReceivedMessage) -> bool:
        props = msg.properties
        try:
            msg_id, due = int(props["BENCH_ID"]), float(props["BENCH_DUE_MS"])
        except (KeyError, ValueError):
            foreign[0] += 1
            return True
        deliver(msg_id, due)
        return True

    return on_message


class _RocketMQSystem(System):
    """Common to the three systems that deliver to a RocketMQ topic read by a push consumer."""

    out_topic = "PEER_OUT"

    def __init__(self, deliver: Deliver, work: Path, mq: LocalRocketMQ, producer: NativeProducer) -> None:
        super().__init__(deliver, work)
        self.mq = mq
        self.producer = producer
        self.consumer: NativePushConsumer | None = None
        self.foreign = [0]

    def open(self) -> None:
        """Create the target topic and start its consumer."""
        self.mq.create_topics([self.out_topic], queues=8)
        self.consumer = NativePushConsumer(f"peers-{self.name}", self.mq.namesrv_addr,
                                           _on_rocketmq(self.deliver, self.foreign),
                                           thread_count=4, max_cache_per_queue=2000,
                                           instance_name=f"peers-{self.name}", log_level=LogLevel.ERROR)
        self.consumer.subscribe(self.out_topic)
        self.consumer.start()

    def _message(self, m: BenchMessage, sent_ms: int) -> OutgoingMessage:
        raise NotImplementedError

    def send(self, msgs: Sequence[BenchMessage]) -> int:
        """The client's asynchronous sends for the batch, waiting for every answer (so a message counts
        as accepted when the broker acknowledged it); a failed one is retried with sync sends."""
        answered = threading.Semaphore(0)
        failed: list[BenchMessage] = []

        def on_answer(m: BenchMessage):  # type: ignore[no-untyped-def]
            def callback(_result: object, error: Exception | None) -> None:
                if error is not None:
                    failed.append(m)
                answered.release()
            return callback

        for m in msgs:
            try:
                self.producer.send_async(self._message(m, now_ms()), on_answer(m))
            except Exception:  # noqa: BLE001 - retried below with a sync send
                failed.append(m)
                answered.release()
        for _ in msgs:
            answered.acquire()
        return len(msgs) - len(failed) + self._send_sync(failed)

    def _send_sync(self, msgs: Sequence[BenchMessage]) -> int:
        """One sync send per message (the client's acknowledged send), retried on failure."""
        ok = 0
        for m in msgs:
            for attempt in range(3):
                try:
                    self.producer.send(self._message(m, now_ms()))
                    ok += 1
                    break
                except Exception as e:  # noqa: BLE001 - a refused send is a result, not a crash
                    if attempt == 2:
                        self._note_failure(e)
                    time.sleep(0.05)
        return ok

    def _note_failure(self, e: Exception) -> None:
        text = f"send failed: {str(e)[:160]}"
        if text not in self.notes and len(self.notes) < 10:
            self.notes.append(text)

    def process_pids(self) -> list[int]:
        """The broker (timewheel adds its engine process)."""
        return [self.mq.broker_pid] if self.mq.broker_pid else []

    def diagnostics(self) -> dict[str, object]:
        """Messages on the target topic without the bench's properties (should be 0)."""
        return {"consumed_without_bench_properties": self.foreign[0]}

    def memory(self) -> MemorySample:
        """Broker RSS and the allocated bytes of its store (commit log, timer log, consume queues)."""
        pid = self.mq.broker_pid
        return MemorySample(rss=tree_rss(pid) if pid else 0, disk=dir_allocated_bytes(self.mq.run_dir / "store"))

    def stop_for_restart(self) -> None:
        """Stop the broker gracefully (the NameServer stays up)."""
        self.mq.stop_broker()

    def start_after_stop(self) -> int | None:
        """Start the broker on the same ports and store; the consumers reconnect by themselves."""
        self.mq.start_broker()
        return None

    def close(self) -> None:
        """Shut the consumer down."""
        if self.consumer is not None:
            self.consumer.shutdown()
            self.consumer = None


class PlainHop(_RocketMQSystem):
    """The floor: plain messages produced to and consumed from the same broker by the same producer and
    consumer as the delay systems, with no delay; "due" is the send time, so lateness is the hop itself."""

    name = "plain-hop"
    out_topic = "PEER_PLAIN"
    phases = ("steady", "steady_high")

    def paced_topics(self) -> tuple[str, str | None]:
        """Plain messages to a topic of their own."""
        return "PEER_PLAIN_JAVA", None

    def _message(self, m: BenchMessage, sent_ms: int) -> OutgoingMessage:
        sent = time.time_ns() / 1e6  # sub-millisecond: the floor is a few ms, whole-ms stamps would blur it
        return OutgoingMessage(self.out_topic, m.body, None, None,
                               {"BENCH_ID": str(m.id), "BENCH_DUE_MS": f"{sent:.3f}"})


class RocketMQTimer(_RocketMQSystem):
    """RocketMQ 5's timer messages: `TIMER_DELIVER_MS` on a normal topic."""

    name = "rocketmq-timer"
    out_topic = "PEER_TIMER"
    max_delay_ms = TIMER_MAX_DELAY_MS - 600_000
    probe_delay_ms = 30_000

    def _message(self, m: BenchMessage, sent_ms: int) -> OutgoingMessage:
        return OutgoingMessage(self.out_topic, m.body, None, None,
                               {"TIMER_DELIVER_MS": str(m.due_ms), "BENCH_ID": str(m.id), "BENCH_DUE_MS": str(m.due_ms)})

    def prefill(self, ids: np.ndarray, dues: np.ndarray, body: bytes) -> dict[str, object]:
        """Producer sends (the broker has no bulk path); first, one message 30 days out, to show the limit."""
        probe = BenchMessage(-1, now_ms() + 30 * DAY_MS, body)
        try:
            self.producer.send(self._message(probe, now_ms()))
            outcome = "accepted"
        except Exception as e:  # noqa: BLE001
            outcome = f"refused (the client reports: {str(e).split(',')[0][:100]})"
        self.notes.append(f"a timer message 30 days out: {outcome}; horizon capped at timerMaxDelaySec (3 days)")
        return super().prefill(ids, dues, body)


class RocketMQLevels(_RocketMQSystem):
    """RocketMQ's delay levels: `DELAY` = the nearest level at or above the wanted delay."""

    name = "rocketmq-levels"
    out_topic = "PEER_LEVEL"
    max_delay_ms = DELAY_LEVELS_MS[-1]
    probe_delay_ms = 30_000  # exactly level 4: the probes are not rounded
    extra_wait_s = 30.0

    def _message(self, m: BenchMessage, sent_ms: int) -> OutgoingMessage:
        level = delay_level(m.due_ms - sent_ms)
        return OutgoingMessage(self.out_topic, m.body, None, None,
                               {"DELAY": str(level), "BENCH_ID": str(m.id), "BENCH_DUE_MS": str(m.due_ms)})

    def prefill(self, ids: np.ndarray, dues: np.ndarray, body: bytes) -> dict[str, object]:
        """Producer sends at the longest level (2 h): no level goes further."""
        self.notes.append("delays beyond 2 h cannot be expressed: the horizon's messages go to level 18 (2 h)")
        return super().prefill(ids, dues, body)


def _revision_of(tree: Path) -> str:
    """The short commit a checkout is at, or its directory's name when git cannot tell."""
    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else tree.name


class Timewheel(_RocketMQSystem):
    """`timewheel serve` as a subprocess: delay topic in, target topic out, on the same broker."""

    name = "timewheel"
    out_topic = "PEER_TW_OUT"
    delay_topic = "TW_DELAY"
    probe_delay_ms = 10_000
    phases: tuple[str, ...] = ("steady", "steady_high", "burst", "horizon", "batch_ingest")

    def paced_topics(self) -> tuple[str, str | None]:
        """Delay messages to the delay topic, for a target topic of their own."""
        return self.delay_topic, "PEER_TW_OUT_JAVA"

    def __init__(self, deliver: Deliver, work: Path, mq: LocalRocketMQ, producer: NativeProducer,
                 stages: Path | None = None, engine_tree: Path | None = None) -> None:
        """`stages`: run the engine under `bench.stage_cpu serve`, its snapshots written there;
        `engine_tree`: run the `timewheel serve` of that checkout (another revision's engine)."""
        super().__init__(deliver, work, mq, producer)
        if stages is not None and engine_tree is not None:
            raise ValueError("stages are measured on this checkout's engine only: drop the engine tree or the stages")
        if engine_tree is not None and (why := not_a_checkout(engine_tree)):
            raise ValueError(why)
        self.stages = stages
        self.engine_tree = engine_tree
        if engine_tree is not None:
            # the horizon's prefill writes this checkout's store layout, which an older engine may refuse
            self.phases = tuple(p for p in self.phases if p != "horizon")
            self.notes.append(f"the engine of {_revision_of(engine_tree)}, another checkout: no horizon phase (its "
                              "prefill writes this checkout's store layout)")
        self.data_dir = work / "data"
        self.proc: subprocess.Popen[bytes] | None = None
        self.admin_port = free_port()
        self.fresh_rss: int | None = None
        self.scheduled_base = 0

    def open(self) -> None:
        """Create the topics, start the consumer and the engine process; note a fresh process's RSS."""
        self.mq.create_topics([self.delay_topic, "TW_DLQ"], queues=8)
        super().open()
        self._start_process()
        time.sleep(2.0)
        self.fresh_rss = tree_rss(self.proc.pid) if self.proc else None

    def _start_process(self, wait: bool = True) -> None:
        """Run `python -m timewheel serve` with its output in the work directory."""
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        log = open(self.work / "serve.log", "ab")
        serve = ["--data-dir", str(self.data_dir), "--namesrv", self.mq.namesrv_addr,
                 "--admin", f"127.0.0.1:{self.admin_port}"]
        run = (["-m", "timewheel", "serve"] if self.stages is None
               else ["-m", "bench.stage_cpu", "serve", "--out", str(self.stages.resolve()), "--"])
        # `python -m` imports from its working directory first: the engine's tree is the code that runs
        self.proc = subprocess.Popen(
            [sys.executable, *run, *serve], stdout=log, stderr=subprocess.STDOUT, env=env,
            cwd=self.engine_tree or Path(__file__).resolve().parents[2])
        log.close()
        self.scheduled_base = 0
        if wait and not wait_until(self._ready, 120, 0.05):
            raise RuntimeError(f"timewheel serve did not become ready: see {self.work / 'serve.log'}")

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"timewheel serve exited with {self.proc.returncode}: see {self.work / 'serve.log'}")
        return admin_ready(self.admin_port)

    def metrics(self) -> dict[str, float]:
        """The engine's Prometheus counters and gauges (unlabelled samples only)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("timewheel_") and "{" not in line:
                name, _, value = line.partition(" ")
                try:
                    out[name] = float(value)
                except ValueError:
                    pass
        return out

    def diagnostics(self) -> dict[str, object]:
        """The engine's counters (cumulative since its process started) beside the consumer's."""
        out = super().diagnostics()
        if self.proc is not None and self.proc.poll() is None:
            keep = ("ingest_ingested_total", "ingest_dead_lettered_total", "ingest_redelivered_total",
                    "scheduled_total", "duplicates_total", "delivered_total", "dead_lettered_total",
                    "send_failures_total", "retries_total", "delivery_failed_total", "ready", "backlog")
            m = self.metrics()
            out.update({k: m.get("timewheel_" + k) for k in keep})
            # the engine's own send lateness (due to the broker's ack) over the last minute: was it the
            # engine that was late, or the hop after it?
            with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/status", timeout=5) as r:
                out["engine_send_lateness_last_minute_ms"] = json.loads(r.read()).get("lateness_last_minute_ms")
        return out

    def _message(self, m: BenchMessage, sent_ms: int) -> OutgoingMessage:
        return OutgoingMessage(self.delay_topic, m.body, None, None,
                               {"TW_TARGET_TOPIC": self.out_topic, "TW_DELIVER_AT_MS": str(m.due_ms),
                                "BENCH_ID": str(m.id), "BENCH_DUE_MS": str(m.due_ms)})

    def wait_stored(self, n: int, timeout: float) -> tuple[int, float]:
        """Wait until the engine has stored `n` more messages (its `scheduled` counter), or until
        the counter stood still for 10 s (messages it dropped as duplicates never count)."""
        deadline = time.monotonic() + timeout
        last, last_t = -1, time.perf_counter()
        while time.monotonic() < deadline:
            got = int(self.metrics().get("timewheel_scheduled_total", 0)) - self.scheduled_base
            if got != last:
                last, last_t = got, time.perf_counter()
            if got >= n or time.perf_counter() - last_t > 10:
                break
            time.sleep(0.02)
        self.scheduled_base += max(0, last)
        return max(0, last), last_t

    def process_pids(self) -> list[int]:
        """The engine process and the broker."""
        return ([self.proc.pid] if self.proc is not None else []) + super().process_pids()

    def memory(self) -> MemorySample:
        """The engine process's RSS, its wheel's bytes and entries, its data directory on disk."""
        rss = tree_rss(self.proc.pid) if self.proc else 0
        m = self.metrics() if self.proc else {}
        return MemorySample(rss=rss, disk=dir_allocated_bytes(self.data_dir),
                            extra={"wheel_bytes": m.get("timewheel_wheel_bytes", 0),
                                   "wheel_entries": m.get("timewheel_wheel_entries", 0)})

    def prefill(self, ids: np.ndarray, dues: np.ndarray, body: bytes) -> dict[str, object]:
        """Stop the engine, append the messages to its store directly (as a backfill does), start it."""
        from storage import Record, ScheduleStore

        self._stop_process()
        now = now_ms()
        store = ScheduleStore(self.data_dir)
        try:
            for start in range(0, len(ids), 20_000):
                store.append([Record(f"h{i}", self.out_topic, body, d,
                                     properties={"BENCH_ID": str(i), "BENCH_DUE_MS": str(d)})
                              for i, d in zip(ids[start:start + 20_000].tolist(), dues[start:start + 20_000].tolist())],
                             now)
        finally:
            store.close()
        self._start_process()
        return {"path": "storage.ScheduleStore.append while the engine was stopped (a backfill), then started"}

    def memory_figures(self, before: MemorySample, loaded: MemorySample, restarted: MemorySample,
                       pending: int) -> dict[str, object]:
        """RSS of a restarted engine with the pending messages over a fresh engine with none."""
        base = self.fresh_rss or before.rss
        return {"bytes_per_pending": round((restarted.rss - base) / pending, 1),
                "disk_per_pending": round((loaded.disk - before.disk) / pending, 1),
                "wheel_bytes": restarted.extra.get("wheel_bytes"), "wheel_entries": restarted.extra.get("wheel_entries"),
                "how": "RSS of the engine process restarted with the pending messages minus RSS of a fresh engine "
                       "with none, / pending; only the current and next hour are in the wheel"}

    def _stop_process(self) -> None:
        if self.proc is not None:
            terminate(self.proc, 60)
            self.proc = None

    def stop_for_restart(self) -> None:
        """SIGTERM the engine (graceful stop: in-flight sends finish, checkpoint)."""
        self._stop_process()

    def start_after_stop(self) -> int | None:
        """Start a new engine process (returns at once; the first delivery is timed by the consumer)."""
        self._start_process(wait=False)
        return None

    def close(self) -> None:
        """Stop the engine and the consumer."""
        self._stop_process()
        super().close()


# -- Redis sorted set ------------------------------------------------------------------------------

_MOVE_DUE = """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
if #due > 0 then
  redis.call('RPUSH', KEYS[2], unpack(due))
  redis.call('ZREM', KEYS[1], unpack(due))
end
return #due
"""


class RedisZset(System):
    """ZADD by producers; a poller runs a Lua script moving due members to a list; BLPOP consumers.

    A member is `id:due:body`. The poller moves up to `batch` members per call and, when fewer
    were due, sleeps until the earliest member's score or `poll_ms`, whichever comes first.
    """

    name = "redis-zset"
    zset, ready = "dq:delayed", "dq:ready"

    def __init__(self, deliver: Deliver, work: Path, poll_ms: float = 10.0, consumers: int = 2,
                 batch: int = 1000) -> None:
        super().__init__(deliver, work)
        self.poll_s = poll_ms / 1000
        self.n_consumers = consumers
        self.batch = batch
        self.server: RedisServer | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def open(self) -> None:
        """Start redis-server, the poller and the consumers."""
        import redis

        self.server = RedisServer()
        self.server.start()
        self.client = redis.Redis(port=self.server.port)
        self._threads = [threading.Thread(target=self._poll, name="redis-poller", daemon=True)]
        self._threads += [threading.Thread(target=self._consume, name=f"redis-consumer-{i}", daemon=True)
                          for i in range(self.n_consumers)]
        for t in self._threads:
            t.start()

    def _poll(self) -> None:
        import redis

        r = redis.Redis(port=self.server.port)  # type: ignore[union-attr]
        move = r.register_script(_MOVE_DUE)
        while not self._stop.is_set():
            try:
                moved = move(keys=[self.zset, self.ready], args=[now_ms(), self.batch])
                if moved >= self.batch:
                    continue
                # redis-py types a reply for every client setting (str members with decode_responses, bare
                # members without scores); this client's, with scores, is [(member bytes, score float)]
                head = cast("list[tuple[bytes, float]]", r.zrange(self.zset, 0, 0, withscores=True))
                wait = self.poll_s if not head else min(self.poll_s, max(0.0, (head[0][1] - now_ms()) / 1000))
                time.sleep(wait)
            except redis.RedisError:
                time.sleep(0.02)  # the server restarts or is loading: try again shortly

    def _consume(self) -> None:
        import redis

        r = redis.Redis(port=self.server.port)  # type: ignore[union-attr]
        while not self._stop.is_set():
            try:
                # redis-py types a reply for every client setting; this client's (no decode_responses) are
                # bytes: BLPOP gives (list name, member) or None, LPOP with a count a list of members or None
                got = cast("tuple[bytes, bytes] | None", r.blpop([self.ready], timeout=1))
                if got is None:
                    continue
                items = [got[1]] + (cast("list[bytes] | None", r.lpop(self.ready, 255)) or [])
            except redis.RedisError:
                time.sleep(0.02)
                continue
            for item in items:
                msg_id, due, _ = item.split(b":", 2)
                self.deliver(int(msg_id), int(due))

    @staticmethod
    def _member(msg_id: int, due: int, body: bytes) -> bytes:
        return b"%d:%d:%s" % (msg_id, due, body)

    def send(self, msgs: Sequence[BenchMessage]) -> int:
        """One ZADD of the whole batch (one round trip)."""
        import redis

        try:
            self.client.zadd(self.zset, {self._member(m.id, m.due_ms, m.body): m.due_ms for m in msgs})
        except redis.RedisError as e:
            self.notes.append(f"ZADD failed: {e}")
            return 0
        return len(msgs)

    def prefill(self, ids: np.ndarray, dues: np.ndarray, body: bytes) -> dict[str, object]:
        """Pipelined ZADDs of 10 000 members each."""
        pipe = self.client.pipeline(transaction=False)
        for start in range(0, len(ids), 10_000):
            pipe.zadd(self.zset, {self._member(i, d, body): d
                                  for i, d in zip(ids[start:start + 10_000].tolist(), dues[start:start + 10_000].tolist())})
            if start // 10_000 % 10 == 9:
                pipe.execute()
        pipe.execute()
        return {"path": "pipelined ZADD, 10 000 members per command"}

    def process_pids(self) -> list[int]:
        """redis-server."""
        return [self.server.proc.pid] if self.server is not None and self.server.proc is not None else []

    def memory(self) -> MemorySample:
        """Server RSS, `used_memory` from INFO, and the AOF files on disk."""
        info = self.client.info("memory")
        return MemorySample(rss=self.server.rss(), disk=dir_allocated_bytes(self.server.dir),  # type: ignore[union-attr]
                            server=int(info["used_memory"]))

    def memory_figures(self, before: MemorySample, loaded: MemorySample, restarted: MemorySample,
                       pending: int) -> dict[str, object]:
        """Growth of Redis's own `used_memory` per pending member."""
        return {"bytes_per_pending": round(((loaded.server or 0) - (before.server or 0)) / pending, 1),
                "rss_per_pending": round((loaded.rss - before.rss) / pending, 1),
                "disk_per_pending": round((loaded.disk - before.disk) / pending, 1),
                "how": "growth of INFO used_memory / pending (everything is in memory; the AOF on disk)"}

    def stop_for_restart(self) -> None:
        """SHUTDOWN (the AOF is flushed); poller and consumers keep retrying."""
        self.server.stop()  # type: ignore[union-attr]

    def start_after_stop(self) -> int | None:
        """Start redis-server on the same port and directory (it replays the AOF)."""
        self.server.start(timeout=300)  # type: ignore[union-attr]
        return None

    def close(self) -> None:
        """Stop the threads and the server."""
        self._stop.set()
        for t in self._threads:
            t.join(5)
        if self.server is not None:
            self.server.close()


# -- PostgreSQL table ------------------------------------------------------------------------------

_SCHEMA = """
CREATE TABLE delayed (id bigint PRIMARY KEY, due_ms bigint NOT NULL, body bytea NOT NULL);
CREATE INDEX delayed_due ON delayed (due_ms);
"""
_CLAIM = """
WITH c AS (SELECT id FROM delayed WHERE due_ms <= %s ORDER BY due_ms LIMIT %s FOR UPDATE SKIP LOCKED)
DELETE FROM delayed d USING c WHERE d.id = c.id RETURNING d.id, d.due_ms, d.body
"""


class Postgres(System):
    """Rows `(id, due_ms, body)` indexed on due time; pollers claim due batches with SKIP LOCKED.

    Each poller deletes up to `batch` due rows per statement (claim and acknowledge at once) and,
    when fewer were due, sleeps until the earliest row's due time or `poll_ms`, whichever is first.
    """

    name = "postgres"

    def __init__(self, deliver: Deliver, work: Path, poll_ms: float = 10.0, pollers: int = 2,
                 batch: int = 500) -> None:
        super().__init__(deliver, work)
        self.poll_s = poll_ms / 1000
        self.n_pollers = pollers
        self.batch = batch
        self.server: PostgresServer | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._local = threading.local()

    def open(self) -> None:
        """initdb, start, create the table, start the pollers."""
        import psycopg

        self.server = PostgresServer()
        self.server.start()
        with psycopg.connect(self.server.conninfo, autocommit=True) as conn:
            conn.execute(_SCHEMA)
        self._threads = [threading.Thread(target=self._poll, name=f"pg-poller-{i}", daemon=True)
                         for i in range(self.n_pollers)]
        for t in self._threads:
            t.start()

    def _connect(self):
        import psycopg

        return psycopg.connect(self.server.conninfo, autocommit=True, connect_timeout=2)  # type: ignore[union-attr]

    def _poll(self) -> None:
        import psycopg

        conn = None
        while not self._stop.is_set():
            try:
                if conn is None or conn.closed:
                    conn = self._connect()
                rows = conn.execute(_CLAIM, (now_ms(), self.batch)).fetchall()
                for msg_id, due, _body in rows:
                    self.deliver(msg_id, due)
                if len(rows) >= self.batch:
                    continue
                head = conn.execute("SELECT due_ms FROM delayed ORDER BY due_ms LIMIT 1").fetchone()
                wait = self.poll_s if head is None else min(self.poll_s, max(0.0, (head[0] - now_ms()) / 1000))
                time.sleep(wait)
            except psycopg.Error:
                if conn is not None:
                    conn.close()
                conn = None
                time.sleep(0.02)  # the server restarts: reconnect shortly
        if conn is not None:
            conn.close()

    def send(self, msgs: Sequence[BenchMessage]) -> int:
        """COPY the batch in one transaction on this thread's connection."""
        import psycopg

        for attempt in range(2):
            try:
                conn = getattr(self._local, "conn", None)
                if conn is None or conn.closed:
                    conn = self._local.conn = psycopg.connect(self.server.conninfo)  # type: ignore[union-attr]
                with conn.transaction(), conn.cursor() as cur:
                    with cur.copy("COPY delayed (id, due_ms, body) FROM STDIN") as copy:
                        for m in msgs:
                            copy.write_row((m.id, m.due_ms, m.body))
                return len(msgs)
            except psycopg.Error as e:
                self._local.conn = None
                if attempt == 1:
                    self.notes.append(f"COPY failed: {str(e)[:160]}")
        return 0

    def prefill(self, ids: np.ndarray, dues: np.ndarray, body: bytes) -> dict[str, object]:
        """COPY in chunks of 50 000 rows, then ANALYZE."""
        import psycopg

        with psycopg.connect(self.server.conninfo) as conn:  # type: ignore[union-attr]
            for start in range(0, len(ids), 50_000):
                with conn.transaction(), conn.cursor() as cur:
                    with cur.copy("COPY delayed (id, due_ms, body) FROM STDIN") as copy:
                        for i, d in zip(ids[start:start + 50_000].tolist(), dues[start:start + 50_000].tolist()):
                            copy.write_row((i, d, body))
            conn.execute("ANALYZE delayed")
        return {"path": "COPY, 50 000 rows per transaction"}

    def process_pids(self) -> list[int]:
        """The postmaster (its backends are counted as its children)."""
        pid = self.server.postmaster_pid() if self.server is not None else None
        return [pid] if pid else []

    def memory(self) -> MemorySample:
        """Server RSS, the shared buffers holding the table and its indexes, and their size on disk."""
        import psycopg

        with psycopg.connect(self.server.conninfo, autocommit=True) as conn:  # type: ignore[union-attr]
            sized = conn.execute("SELECT pg_total_relation_size('delayed')").fetchone()
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_buffercache")
            held = conn.execute(
                "SELECT count(*) * current_setting('block_size')::bigint FROM pg_buffercache b "
                "WHERE b.reldatabase = (SELECT oid FROM pg_database WHERE datname = current_database()) "
                "AND b.relfilenode IN (SELECT pg_relation_filenode(c) FROM unnest(ARRAY['delayed', "
                "'delayed_pkey', 'delayed_due']::regclass[]) c)").fetchone()
        assert sized is not None and held is not None  # an aggregate query answers one row
        return MemorySample(rss=self.server.rss(), disk=int(sized[0]), server=int(held[0]))  # type: ignore[union-attr]

    def memory_figures(self, before: MemorySample, loaded: MemorySample, restarted: MemorySample,
                       pending: int) -> dict[str, object]:
        """Shared buffers holding the table and indexes, per pending row; table + indexes on disk beside it."""
        return {"bytes_per_pending": round(((loaded.server or 0) - (before.server or 0)) / pending, 1),
                "rss_per_pending": round((loaded.rss - before.rss) / pending, 1),
                "disk_per_pending": round((loaded.disk - before.disk) / pending, 1),
                "how": "growth of the shared buffers caching the table and its indexes (pg_buffercache) / pending, "
                       "capped by shared_buffers (128 MB); disk is pg_total_relation_size (table, primary key, "
                       "due index)"}

    def stop_for_restart(self) -> None:
        """pg_ctl stop -m fast (the pollers keep reconnecting)."""
        self.server.stop()  # type: ignore[union-attr]

    def start_after_stop(self) -> int | None:
        """pg_ctl start -w."""
        self.server.start()  # type: ignore[union-attr]
        return None

    def close(self) -> None:
        """Stop the pollers and the server."""
        self._stop.set()
        for t in self._threads:
            t.join(5)
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
        if self.server is not None:
            self.server.close()


# -- heapq engine ------------------------------------------------------------------------------------


class Heap(System):
    """The heapq engine in this process; its restart is a new process rebuilding from the log."""

    name = "heapq"
    probe_delay_ms = 2_000

    def __init__(self, deliver: Deliver, work: Path) -> None:
        super().__init__(deliver, work)
        self.log_dir = work / "log"
        self.engine: HeapEngine | None = None
        self.child: dict[str, Any] | None = None  # the restarted engine process's JSON report

    def open(self) -> None:
        """Start the engine."""
        self.engine = HeapEngine(self.log_dir, lambda i, d, _b: self.deliver(i, d)).start()

    def send(self, msgs: Sequence[BenchMessage]) -> int:
        """Log and push the batch."""
        self.engine.schedule([(m.id, m.due_ms, m.body) for m in msgs])  # type: ignore[union-attr]
        return len(msgs)

    def prefill(self, ids: np.ndarray, dues: np.ndarray, body: bytes) -> dict[str, object]:
        """schedule() in chunks of 20 000."""
        for start in range(0, len(ids), 20_000):
            self.engine.schedule([(i, d, body) for i, d in  # type: ignore[union-attr]
                                  zip(ids[start:start + 20_000].tolist(), dues[start:start + 20_000].tolist())])
        return {"path": "HeapEngine.schedule, 20 000 per call"}

    def memory(self) -> MemorySample:
        """This process's RSS (shared with the harness: the restarted child gives the clean figure)."""
        return MemorySample(rss=tree_rss(os.getpid()), disk=dir_allocated_bytes(self.log_dir))

    def memory_figures(self, before: MemorySample, loaded: MemorySample, restarted: MemorySample,
                       pending: int) -> dict[str, object]:
        """RSS growth of the restarted engine process over its rebuild, per pending message."""
        child = self.child or {}
        per = None
        if child.get("pending"):
            per = round((int(child["rss_after"]) - int(child["rss_before"])) / int(child["pending"]), 1)
        return {"bytes_per_pending": per, "disk_per_pending": round((loaded.disk - before.disk) / pending, 1),
                "rebuild_s": child.get("rebuild_s"),
                "how": "RSS growth of a fresh engine process across its rebuild (heap of (due, offset) tuples) "
                       "/ pending; bodies stay in the log on disk"}

    def stop_for_restart(self) -> None:
        """Stop the engine: the heap is gone, the log stays."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def start_after_stop(self) -> int | None:
        """Run a new engine process on the log; it reports when it released its first message."""
        proc = subprocess.run([sys.executable, "-m", "bench.peers.heap_engine", "--log-dir", str(self.log_dir)],
                              capture_output=True, text=True, check=False, cwd=Path(__file__).resolve().parents[2],
                              timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"heap engine restart failed: {proc.stderr[-500:]}")
        self.child = json.loads(proc.stdout.strip().splitlines()[-1])
        first = self.child.get("first_release_ns")
        return int(first) if first else None

    def close(self) -> None:
        """Stop the engine and delete its logs."""
        self.stop_for_restart()
        remove_tree(self.log_dir)
