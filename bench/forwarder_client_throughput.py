"""Throughput of the RocketMQ client paths the forwarder can use, against a real local broker.

Run from the repository root (starts and stops its own LocalRocketMQ):

    .venv/bin/python -m bench.forwarder_client_throughput [--messages 20000] [--consume 50000]

Send cases send `--messages` bodies of `--body-size` bytes each; consume cases read `--consume`
messages pre-filled into an 8-queue topic, each case with a fresh consumer group, timed from the
first message received to the last (start-up and rebalance excluded). Each case also reports the
CPU time per message of this process and of the broker JVM, which a busy machine skews less than
the rates. Results of a run are kept in bench/forwarder_client_throughput_results.md
(`--out bench/forwarder_client_throughput_results.md`).
"""

from __future__ import annotations

import argparse
import os
import platform
import threading
import time
from collections.abc import Callable
import dataclasses
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TypedDict, Unpack

from rocketmq.client import ConsumeStatus, Message, Producer, PushConsumer, RecvMessage
from rocketmq.exceptions import RocketMQException

from bench.peers.common import process_cpu_seconds
from forwarder._rmq_native import NativeProducer, NativePushConsumer
from forwarder.rocketmq import OutgoingMessage, ReceivedMessage, RemotingProducer, SendResult
from forwarder.errors import SendError
from forwarder.local_rocketmq import LocalRocketMQ

WARMUP_TOPIC = "BENCH_WARMUP"
SEND_TOPIC = "BENCH_SEND"
CONSUME_TOPIC = "BENCH_CONSUME"
QUEUES = 8


@dataclass(frozen=True)
class Row:
    """One measured case."""

    case: str
    messages: int
    seconds: float
    note: str = ""
    client_cpu_us: float = float("nan")  # CPU time of this process per message
    broker_cpu_us: float = float("nan")  # CPU time of the broker JVM per message

    @property
    def rate(self) -> float:
        """Messages per second."""
        return self.messages / self.seconds if self.seconds > 0 else float("inf")


class CpuMeter:
    """CPU seconds used by this process and by the broker: less sensitive to a busy machine than rates."""

    def __init__(self, broker_pid: int | None) -> None:
        self._pid = broker_pid

    def sample(self) -> tuple[float, float]:
        """(this process, broker) CPU seconds so far; broker NaN where /proc is not available."""
        times = os.times()
        own = times.user + times.system
        try:
            broker = sum(process_cpu_seconds(self._pid)) if self._pid else float("nan")
        except (OSError, IndexError, ValueError):
            broker = float("nan")
        return own, broker

    def measure(self, case: Callable[[], Row]) -> Row:
        """Run one case and attach the CPU time per message it cost on both sides."""
        own0, broker0 = self.sample()
        row = case()
        own1, broker1 = self.sample()
        n = max(1, row.messages)
        print(f"{row.case}: {row.rate:,.0f} msg/s {row.note}", flush=True)
        return dataclasses.replace(row, client_cpu_us=(own1 - own0) / n * 1e6, broker_cpu_us=(broker1 - broker0) / n * 1e6)


def _threads(n_threads: int, total: int, work: Callable[[int], None]) -> float:
    """Run work(count) on `n_threads` threads sharing `total` sends; return wall seconds."""
    share = [total // n_threads + (1 if i < total % n_threads else 0) for i in range(n_threads)]
    errors: list[BaseException] = []

    def run(count: int) -> None:
        try:
            work(count)
        except BaseException as e:  # reported after the join
            errors.append(e)

    threads = [threading.Thread(target=run, args=(c,)) for c in share]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    if errors:
        raise errors[0]
    return elapsed


def bench_wrapper_send_sync(ns: str, total: int, body: bytes, n_threads: int) -> Row:
    """The wrapper's Producer.send_sync, one Message object per send."""
    producer = Producer(f"bench_wrapper_{n_threads}")
    producer.set_namesrv_addr(ns)
    producer.start()
    text = body.decode("ascii")  # the wrapper's set_body stops at a NUL: ASCII bodies only
    failures = _Failures()

    def work(count: int) -> None:
        for _ in range(count):
            msg = Message(SEND_TOPIC)
            msg.set_tags("t")
            msg.set_keys("k")
            msg.set_body(text)
            try:
                producer.send_sync(msg)
            except RocketMQException as e:
                failures.add(e)
            # Message.destroy() is never called by the wrapper itself; do it to be fair.
            msg.destroy()

    try:
        producer.send_sync(_wrapper_message(text))  # warm-up: route lookup, connection
        elapsed = _threads(n_threads, total, work)
    finally:
        producer.shutdown()
    return Row(f"wrapper send_sync, {n_threads} thread(s)", total - failures.count, elapsed, failures.note())


def _wrapper_message(text: str) -> Message:
    """A wrapper Message to SEND_TOPIC."""
    msg = Message(SEND_TOPIC)
    msg.set_body(text)
    return msg


class _Failures:
    """Thread-safe count of failed sends, with the first error's text."""

    def __init__(self) -> None:
        self.count = 0
        self.first = ""
        self._lock = threading.Lock()

    def add(self, error: BaseException) -> None:
        """Record one failure."""
        with self._lock:
            self.count += 1
            if not self.first:
                self.first = str(error).split(",error:")[0]

    def note(self) -> str:
        """Describe the failures for the table ("" if none)."""
        return f"{self.count} sends failed ({self.first})" if self.count else ""


def bench_native_send(producer: NativeProducer, total: int, body: bytes, n_threads: int) -> Row:
    """NativeProducer.send (SendMessageSync with a binary body)."""
    msg = OutgoingMessage(SEND_TOPIC, body, tags="t", keys="k", properties={"p": "v"})
    failures = _Failures()

    def work(count: int) -> None:
        for _ in range(count):
            try:
                producer.send(msg)
            except SendError as e:
                failures.add(e)

    elapsed = _threads(n_threads, total, work)
    return Row(f"native send, {n_threads} thread(s)", total - failures.count, elapsed, failures.note())


def bench_native_async(producer: NativeProducer, total: int, body: bytes, topic: str = SEND_TOPIC) -> Row:
    """NativeProducer.send_async from one thread, bounded in-flight window."""
    msg = OutgoingMessage(topic, body, tags="t", keys="k", properties={"p": "v"})
    failures = _Failures()

    def done(result: SendResult | None, error: SendError | None) -> None:
        if error is not None:
            failures.add(error)

    start = time.perf_counter()
    for _ in range(total):
        producer.send_async(msg, done)
    if not producer.flush(120):
        raise RuntimeError("async sends did not complete in 120 s")
    elapsed = time.perf_counter() - start
    return Row("native send_async, 1 thread", total - failures.count, elapsed, failures.note())


def bench_batch(producer: NativeProducer, total: int, body: bytes, size: int) -> Row:
    """SendBatchMessage: measures the wire only (the broker stores each batch as ONE message)."""
    msgs = [OutgoingMessage(SEND_TOPIC, body, tags="t", keys=f"k{i}", properties={"i": str(i)}) for i in range(size)]
    batches = max(1, total // size)
    start = time.perf_counter()
    for _ in range(batches):
        producer._send_batch(msgs)
    elapsed = time.perf_counter() - start
    return Row(f"SendBatchMessage, batches of {size}", batches * size, elapsed, "UNUSABLE: stored as 1 message/batch")


def bench_wire_batch(ns: str, total: int, body: bytes, size: int) -> Row:
    """The wire client (RemotingProducer): correct batches, one round trip per batch of `size`."""
    sender = RemotingProducer(ns, "bench_wire", max_batch_messages=size)
    msgs = [OutgoingMessage(SEND_TOPIC, body, tags="t", keys=f"k{i}", properties={"i": str(i)}) for i in range(size)]
    batches = max(1, total // size)
    try:
        start = time.perf_counter()
        for _ in range(batches):
            sender.send_batch(SEND_TOPIC, msgs)
        elapsed = time.perf_counter() - start
    finally:
        sender.close()
    return Row(f"wire SEND_BATCH_MESSAGE (RemotingProducer), batches of {size}", batches * size, elapsed)


def check_wire_batch(mq: LocalRocketMQ) -> str:
    """Verify that a wire batch arrives as separate messages with their own tags and properties."""
    topic = "BENCH_WIRE_CHECK"
    mq.create_topics([topic], queues=1)
    sender = RemotingProducer(mq.namesrv_addr, "bench_wire_check")
    try:
        receipts = sender.send_batch(topic, [OutgoingMessage(topic, b"m%d" % i, tags=f"t{i}", properties={"i": str(i)})
                                             for i in range(3)])
        ids = [r.msg_id for r in receipts]
    finally:
        sender.close()
    got: list[ReceivedMessage] = []
    done = threading.Event()

    def on_message(msg: ReceivedMessage) -> bool:
        got.append(msg)
        if len(got) >= 3:
            done.set()
        return True

    consumer = NativePushConsumer("bench_wire_check", mq.namesrv_addr, on_message)
    consumer.subscribe(topic)
    consumer.start()
    try:
        done.wait(60)
    finally:
        consumer.shutdown()
    ok = sorted((m.msg_id, m.tags, m.properties.get("i"), m.body) for m in got) == sorted(
        (ids[i], f"t{i}", str(i), b"m%d" % i) for i in range(3)
    )
    return "wire batch check: 3 separate messages, ids/tags/properties kept" if ok else f"wire batch check FAILED: {got}"


class _Counter:
    """Counts consumed messages and timestamps the first and the target-th one."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.count = 0
        self.first = 0.0
        self.last = 0.0
        self.done = threading.Event()
        self._lock = threading.Lock()

    def hit(self) -> None:
        """Record one message."""
        with self._lock:
            self.count += 1
            now = time.perf_counter()
            if self.count == 1:
                self.first = now
            if self.count == self.target:
                self.last = now
                self.done.set()


def bench_wrapper_consume(ns: str, total: int, group: str) -> Row:
    """The wrapper's PushConsumer with its defaults, reading body and id of each message."""
    counter = _Counter(total)

    def on_message(msg: RecvMessage) -> ConsumeStatus:
        _ = msg.body, msg.id
        counter.hit()
        return ConsumeStatus.CONSUME_SUCCESS

    consumer = PushConsumer(group)
    consumer.set_namesrv_addr(ns)
    consumer.subscribe(CONSUME_TOPIC, on_message)
    consumer.start()
    try:
        finished = counter.done.wait(300)
    finally:
        consumer.shutdown()
    return _consume_row("wrapper PushConsumer, defaults", counter, finished)


class ConsumerOptions(TypedDict, total=False):
    """The NativePushConsumer settings a consume case varies."""
    thread_count: int
    max_cache_per_queue: int
    batch_max_size: int


def bench_native_consume(ns: str, total: int, group: str, label: str, **options: Unpack[ConsumerOptions]) -> Row:
    """NativePushConsumer (full decode: binary body and all properties) with `options`."""
    counter = _Counter(total)

    def on_message(msg: ReceivedMessage) -> bool:
        counter.hit()
        return True

    consumer = NativePushConsumer(group, ns, on_message, **options)
    consumer.subscribe(CONSUME_TOPIC)
    consumer.start()
    try:
        finished = counter.done.wait(300)
    finally:
        consumer.shutdown()
    return _consume_row(label, counter, finished)


def _consume_row(label: str, counter: _Counter, finished: bool) -> Row:
    """Turn a counter into a Row (partial when the target was not reached)."""
    if not finished:
        return Row(label, counter.count, 300.0, f"only {counter.count}/{counter.target} in 300 s")
    return Row(label, counter.target, counter.last - counter.first)


def main(argv: list[str] | None = None) -> None:
    """Run every case and print a markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20000, help="messages per send case")
    parser.add_argument("--consume", type=int, default=50000, help="messages per consume case")
    parser.add_argument("--body-size", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20000, help="messages sent before measuring (broker JIT)")
    parser.add_argument("--out", type=Path, default=None, help="also write the table to this file")
    args = parser.parse_args(argv)
    body = b"x" * args.body_size
    rows: list[Row] = []
    load = os.getloadavg()[0]

    with LocalRocketMQ() as mq:
        mq.create_topics([WARMUP_TOPIC, SEND_TOPIC, CONSUME_TOPIC], queues=QUEUES)
        ns = mq.namesrv_addr
        meter = CpuMeter(mq.broker_pid)
        with NativeProducer("bench_warmup", ns) as warmup:
            print("warm-up", bench_native_async(warmup, args.warmup, body, WARMUP_TOPIC))
        for n in (1, 4, 8):
            rows.append(meter.measure(partial(bench_wrapper_send_sync, ns, args.messages, body, n)))
        with NativeProducer("bench_native", ns) as producer:
            producer.send(OutgoingMessage(SEND_TOPIC, body))  # warm-up
            for n in (1, 4, 8):
                rows.append(meter.measure(partial(bench_native_send, producer, args.messages, body, n)))
            rows.append(meter.measure(lambda: bench_native_async(producer, args.messages, body)))
            for size in (32, 128):
                rows.append(meter.measure(partial(bench_batch, producer, args.messages, body, size)))
            for size in (32, 128):
                rows.append(meter.measure(partial(bench_wire_batch, ns, args.messages, body, size)))
            print(check_wire_batch(mq))
            # Fill the consume topic (async: the fastest correct path of the bundled client).
            print("filled", bench_native_async(producer, args.consume, body, CONSUME_TOPIC))
        rows.append(meter.measure(lambda: bench_wrapper_consume(ns, args.consume, "bench_c_wrapper")))
        native_cases: list[tuple[str, ConsumerOptions]] = [
            ("native PushConsumer, defaults (threads = CPUs)", {}),
            ("native PushConsumer, 4 threads", {"thread_count": 4}),
            ("native PushConsumer, 8 threads, cache 2000/queue", {"thread_count": 8, "max_cache_per_queue": 2000}),
            ("native PushConsumer, batch_max_size 32", {"batch_max_size": 32}),
        ]
        for i, (label, options) in enumerate(native_cases):
            rows.append(
                meter.measure(
                    partial(bench_native_consume, ns, args.consume, f"bench_c_native_{i}", label, **options)
                )
            )

    table = _table(rows, args, load)
    print(table)
    if args.out is not None:
        args.out.write_text(table)


def _table(rows: list[Row], args: argparse.Namespace, load: float) -> str:
    """Format the results as markdown, with the machine and the command that produced them."""
    lines = [
        "# forwarder client throughput",
        "",
        f"Command: `.venv/bin/python -m bench.forwarder_client_throughput --messages {args.messages} "
        f"--consume {args.consume} --body-size {args.body_size} --warmup {args.warmup}`",
        f"Machine: {os.cpu_count()} CPUs, {platform.platform()}, Python {platform.python_version()}; "
        f"broker: local Apache RocketMQ 5.3.3 on loopback, {QUEUES} queues per topic; "
        f"1-minute load average before the run: {load:.1f} (other work on the machine skews the figures).",
        "",
        "CPU columns: CPU time per message of this Python process and of the broker JVM during the case",
        "(consume cases include the consumer's start-up), steadier than msg/s when the machine is shared.",
        "",
        "| case | messages | seconds | msg/s | client CPU µs/msg | broker CPU µs/msg | note |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    lines += [
        f"| {r.case} | {r.messages} | {r.seconds:.2f} | {r.rate:,.0f} | {r.client_cpu_us:.0f} | "
        f"{r.broker_cpu_us:.0f} | {r.note} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
