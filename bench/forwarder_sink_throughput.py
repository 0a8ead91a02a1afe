"""Delivery throughput through `RocketMQSink.send_batch`, against a real local broker.

Run from the repository root (starts and stops its own LocalRocketMQ):

    .venv/bin/python -m bench.forwarder_sink_throughput [--messages 50000] [--out bench/forwarder_sink_throughput_results.md]

Each case calls `send_batch` from one thread (as the engine's dispatch thread does) with calls of
32, 128 or 256 due messages of `--body-size` bytes (tags, keys, two user properties, an original
id), all for one topic or spread round robin over 3 topics (8 queues each), and reports msg/s, the
latency of one call (median/p90/p99/max) and the CPU time per message of this process and of the
broker JVM. One case repeats the sink of before (native sync sends from a pool of 8 threads) under
the same conditions. After the cases, a consumer counts what the broker stored, so that a message
stored twice or never would show.
"""

from __future__ import annotations

import argparse
import os
import platform
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.forwarder_client_throughput import CpuMeter, Row
from forwarder._rmq_native import LogLevel, NativeProducer, NativePushConsumer
from forwarder.rocketmq import ReceivedMessage, RemotingProducer
from forwarder.contract import to_outgoing
from forwarder.delivery import RocketMQSink
from forwarder.local_rocketmq import ROCKETMQ_VERSION, LocalRocketMQ
from forwarder.config import RocketMQConfig
from timewheel.message import Message

TOPICS = ("BENCH_SINK_1", "BENCH_SINK_2", "BENCH_SINK_3")
WARMUP_TOPIC = "BENCH_SINK_WARMUP"
QUEUES = 8


@dataclass(frozen=True)
class Case:
    """One measured configuration and its per-call latencies."""

    row: Row
    call_ms: tuple[float, ...]


def _messages(n: int, topics: Sequence[str], body: bytes) -> list[Message]:
    """Due messages as the engine hands them to the sink."""
    now = int(time.time() * 1000)
    return [Message(topics[i % len(topics)], body, now, f"tag{i % 4}", (f"k{i}", "order"),
                    {"customer": "Zoë", "seq": str(i)}, f"{i:032X}") for i in range(n)]


def run_sink(sink: "RocketMQSink | NativePoolSink", messages: list[Message], per_call: int, label: str) -> Case:
    """Feed `messages` to the sink `per_call` at a time; every message must be accepted."""
    calls: list[float] = []
    failed = 0
    start = time.perf_counter()
    for i in range(0, len(messages), per_call):
        t = time.perf_counter()
        results = sink.send_batch(messages[i : i + per_call])
        calls.append((time.perf_counter() - t) * 1000)
        failed += results.count(False)
    elapsed = time.perf_counter() - start
    note = f"{failed} failed" if failed else ""
    return Case(Row(label, len(messages) - failed, elapsed, note), tuple(calls))


class NativePoolSink:
    """The sink as it was before the wire batches: native sync sends from a pool of threads."""

    def __init__(self, producer: NativeProducer, threads: int = 8) -> None:
        self._producer = producer
        self._pool = ThreadPoolExecutor(threads)
        self._threads = threads

    def send_batch(self, messages: Sequence[Message]) -> list[bool]:
        """Send every message, split over the pool."""
        n = min(self._threads, len(messages))
        chunks = [messages[i::n] for i in range(n)]
        parts = list(self._pool.map(lambda ms: [self._one(m) for m in ms], chunks))
        results = [False] * len(messages)
        for i, part in enumerate(parts):
            results[i::n] = part
        return results

    def _one(self, m: Message) -> bool:
        try:
            self._producer.send(to_outgoing(m))
            return True
        except Exception:
            return False

    def close(self) -> None:
        """Stop the pool."""
        self._pool.shutdown()


def measured(meter: CpuMeter, run: Callable[[], Case]) -> Case:
    """Run one case under the CPU meter."""
    done: list[Case] = []

    def case() -> Row:
        done.append(run())
        return done[0].row

    row = meter.measure(case)
    return Case(row, done[0].call_ms)


def count_stored(namesrv: str, topics: Sequence[str], expected: int, timeout: float = 300.0) -> tuple[int, int]:
    """Consume the topics from the start; return (messages, distinct ids)."""
    seen: list[str] = []
    lock = threading.Lock()
    done = threading.Event()

    def on_message(msg: ReceivedMessage) -> bool:
        with lock:
            seen.append(msg.msg_id)
            if len(seen) >= expected:
                done.set()
        return True

    consumer = NativePushConsumer("bench_sink_count", namesrv, on_message, thread_count=4,
                                  max_cache_per_queue=2000, log_level=LogLevel.ERROR)
    for t in topics:
        consumer.subscribe(t)
    consumer.start()
    try:
        done.wait(timeout)
        time.sleep(2.0)  # anything stored twice would arrive now
    finally:
        consumer.shutdown()
    with lock:
        return len(seen), len(set(seen))


def main(argv: list[str] | None = None) -> None:
    """Run every case and print a markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=50000, help="messages per case")
    parser.add_argument("--body-size", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=50000, help="messages sent before measuring (broker JIT)")
    parser.add_argument("--native-messages", type=int, default=20000, help="messages of the native pool case")
    parser.add_argument("--out", type=Path, default=None, help="also write the table to this file")
    args = parser.parse_args(argv)
    body = b"x" * args.body_size
    load_before = os.getloadavg()
    cases: list[Case] = []
    with LocalRocketMQ(stop_timeout=3.0) as mq:
        mq.create_topics([WARMUP_TOPIC, *TOPICS], queues=QUEUES)
        cfg = RocketMQConfig(namesrv=mq.namesrv_addr, producer_group="bench_sink", dead_letter_topic=WARMUP_TOPIC)
        meter = CpuMeter(mq.broker_pid)
        with NativeProducer("bench_sink_native", mq.namesrv_addr, log_level=LogLevel.ERROR) as producer:
            dead_letters = RemotingProducer(cfg.namesrv, cfg.producer_group)
            sink = RocketMQSink(cfg, dead_letters)
            try:
                print("warm-up", run_sink(sink, _messages(args.warmup, [WARMUP_TOPIC], body), 128, "warm-up").row)
                for topics in (TOPICS[:1], TOPICS):
                    for per_call in (32, 128, 256):
                        label = f"sink, calls of {per_call}, {len(topics)} topic(s)"
                        msgs = _messages(args.messages, topics, body)
                        cases.append(measured(meter, lambda: run_sink(sink, msgs, per_call, label)))
                stored_expected = sum(c.row.messages for c in cases)
            finally:
                sink.close()
                dead_letters.close()
            native = NativePoolSink(producer)
            try:
                msgs = _messages(args.native_messages, [WARMUP_TOPIC], body)
                label = "before: native sync sends, pool of 8 threads, calls of 256, 1 topic"
                cases.append(measured(meter, lambda: run_sink(native, msgs, 256, label)))
            finally:
                native.close()
        stored, distinct = count_stored(mq.namesrv_addr, TOPICS, stored_expected)
        check = (f"consumed back from the 3 topics: {stored} messages, {distinct} distinct ids, "
                 f"{stored_expected} sent")
        print(check)
    load_after = os.getloadavg()
    table = _table(cases, args, load_before, load_after, check)
    print(table)
    if args.out is not None:
        args.out.write_text(table)


def _table(cases: list[Case], args: argparse.Namespace, before: tuple[float, float, float],
           after: tuple[float, float, float], check: str) -> str:
    """Format the results as markdown, with the machine and the command that produced them."""
    lines = [
        "# delivery throughput through RocketMQSink.send_batch",
        "",
        f"Command: `.venv/bin/python -m bench.forwarder_sink_throughput --messages {args.messages} "
        f"--body-size {args.body_size} --warmup {args.warmup} --native-messages {args.native_messages}`",
        f"Machine: {os.cpu_count()} CPUs, {platform.platform()}, Python {platform.python_version()}; broker: local "
        f"Apache RocketMQ {ROCKETMQ_VERSION} on loopback, {QUEUES} queues per topic; load average (1/5/15 min) "
        f"before {before[0]:.1f}/{before[1]:.1f}/{before[2]:.1f}, after {after[0]:.1f}/{after[1]:.1f}/{after[2]:.1f} "
        "(the machine is shared: other work skews msg/s more than the CPU columns).",
        "",
        "One thread calls send_batch, as the engine's dispatch thread does; call latency is one send_batch.",
        f"Check: {check}.",
        "",
        "| case | messages | seconds | msg/s | call p50 ms | p90 | p99 | max | client CPU µs/msg | "
        "broker CPU µs/msg | note |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for c in cases:
        r = c.row
        p50, p90, p99 = np.percentile(c.call_ms, [50, 90, 99]) if c.call_ms else (0.0, 0.0, 0.0)
        lines.append(f"| {r.case} | {r.messages} | {r.seconds:.2f} | {r.rate:,.0f} | {p50:.2f} | {p90:.2f} | "
                     f"{p99:.2f} | {max(c.call_ms, default=0):.2f} | {r.client_cpu_us:.0f} | {r.broker_cpu_us:.0f} | "
                     f"{r.note} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
