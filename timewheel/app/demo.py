"""`timewheel demo`: a local RocketMQ, the engine, a producer and a consumer, with live lateness.

The producer sends a realistic mix to the delay topic (several target topics, delays from 1 s to
a few minutes, keys and tags, a few messages that break the contract); some messages are cancelled
by business key before they are due. A consumer on the target topics measures lateness (receive
time minus due time). At the end every message that was sent is accounted for: delivered,
cancelled, dead-lettered, or lost.
"""
from __future__ import annotations

import json
import logging
import math
import random
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Mapping

from hdrh.histogram import HdrHistogram
from rich.console import Console
from rich.live import Live
from rich.table import Table

from forwarder.config import RocketMQConfig
from timewheel.config import EngineConfig
from timewheel.errors import TimewheelError
from timewheel.lateness import hdr_percentiles
from timewheel.app.humantime import human_time
from timewheel.app.service import Service
from timewheel.app.settings import AdminConfig, Settings

if TYPE_CHECKING:
    from forwarder._rmq_native import NativeProducer
    from forwarder.rocketmq import OutgoingMessage, SendResult

TOPICS = ("ORDERS", "PAYMENTS", "REMINDERS")


@dataclass
class DemoState:
    """What the demo's producer and consumer saw, shared between their threads."""

    sent: int = 0
    sent_bad: int = 0
    send_errors: int = 0
    cancel_requested: int = 0
    cancelled: int = 0
    delivered_ids: set[str] = field(default_factory=set)
    dead_lettered_ids: set[str] = field(default_factory=set)
    duplicates: int = 0
    valid_ids: set[str] = field(default_factory=set)
    last_due_ms: int = 0
    lateness: HdrHistogram = field(default_factory=lambda: HdrHistogram(1, 3_600_000_000, 3))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def lateness_ms(self) -> dict[str, float]:
        """p50/p99/max lateness so far, ms."""
        h = self.lateness
        if not h.get_total_count():
            return {"p50": 0.0, "p99": 0.0, "max": 0.0}
        p50, p99 = hdr_percentiles(h, (50, 99))
        return {"p50": p50 / 1000, "p99": p99 / 1000, "max": h.get_max_value() / 1000}


def _rows(state: DemoState, stats: Mapping[str, object]) -> list[tuple[str, str]]:
    """What the live view shows, as (label, value) pairs: counts, lateness, pending per segment (UTC)."""
    lat = state.lateness_ms()
    with state.lock:
        rows = [("sent", f"{state.sent + state.sent_bad:,}"), ("delivered", f"{len(state.delivered_ids):,}"),
                ("cancelled", f"{state.cancelled:,}"), ("dead-lettered", f"{len(state.dead_lettered_ids):,}")]
    rows += [("in the wheel", f"{stats.get('wheel_entries', 0):,}"), ("retrying", f"{stats.get('retrying', 0):,}"),
             ("lateness p50", f"{lat['p50']:.1f} ms"), ("lateness p99", f"{lat['p99']:.1f} ms"),
             ("lateness max", f"{lat['max']:.1f} ms")]
    segments: Mapping[str, int] = stats.get("loaded_segments") or {}  # type: ignore[assignment]
    rows += [(f"pending {human_time(k)}", f"{v:,}") for k, v in sorted(segments.items())]
    return rows


def _table(title: str, rows: list[tuple[str, str]]) -> Table:
    """The live view: one small two-column table, so it fits 80x24 with the lines above it."""
    t = Table(title=title, show_header=False, title_justify="left", min_width=56)  # the title fits on one line
    t.add_column("what", no_wrap=True)
    t.add_column("n", justify="right", no_wrap=True)
    for row in rows:
        t.add_row(*row)
    return t


def _line(title: str, rows: list[tuple[str, str]]) -> str:
    """The same view as one plain line, for output that is not a terminal."""
    return f"{title}: " + ", ".join(f"{k} {v}" for k, v in rows)


class _View:
    """Shows each update: in place in a terminal (rich Live), else as one plain line per update."""

    def __init__(self, console: Console, state: DemoState, service: Service) -> None:
        self.console = console
        self.state = state
        self.service = service
        self.live: Live | None = None
        self._last_line = 0.0

    def __enter__(self) -> "_View":
        if self.console.is_terminal:
            first = _table("timewheel demo: starting", _rows(self.state, self.service.stats()))
            self.live = Live(first, console=self.console, refresh_per_second=4, vertical_overflow="crop")
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.__exit__(None, None, None)

    def update(self, phase: str, *, final: bool = False) -> None:
        """Show the current numbers (a plain line at most once a second, and the final one)."""
        title = f"timewheel demo: {phase}"
        rows = _rows(self.state, self.service.stats())
        if self.live is not None:
            self.live.update(_table(title, rows))
        elif final or time.monotonic() - self._last_line >= 1.0:
            self._last_line = time.monotonic()
            self.console.print(_line(title, rows), soft_wrap=True, markup=False, highlight=False)


def _send(producer: "NativeProducer", msg: "OutgoingMessage", state: DemoState) -> "SendResult | None":
    """Send, counting a refused send instead of dying: a producer's failures are the producer's."""
    from forwarder import ForwarderError

    try:
        return producer.send(msg)
    except ForwarderError:
        with state.lock:
            state.send_errors += 1
        return None


class DemoError(TimewheelError):
    """The demo cannot run as asked, or its pipeline did not come up; the message says what to change or read."""


def _check_inputs(duration: float, rate: int) -> None:
    """Refuse, before anything starts, a rate or a duration the producer cannot run at."""
    if rate < 1:  # the producer paces itself by 1 / rate
        raise DemoError(f"--rate {rate} is invalid: it must be at least 1 (messages per second)")
    if not 0 < duration < math.inf:  # NaN fails this too
        raise DemoError(f"--duration {duration:g} is invalid: it must be a finite number of seconds above 0")


def _warm_up(producer: "NativeProducer", cfg: RocketMQConfig, state: DemoState, console: Console, work: Path) -> None:
    """Wait until a probe went producer -> engine -> consumer: consumer groups take seconds to rebalance."""
    from forwarder.rocketmq import OutgoingMessage

    console.print("waiting for the consumers to join their groups ...")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        res = _send(producer, OutgoingMessage(cfg.delay_topic, b"probe", None, None,
                                              {"TW_TARGET_TOPIC": TOPICS[0], "TW_DELAY_MS": "0"}), state)
        for _ in range(20):
            with state.lock:
                if res is not None and res.msg_id in state.delivered_ids:
                    state.delivered_ids.clear()
                    state.lateness.reset()
                    state.send_errors = 0
                    return
            time.sleep(0.1)
    raise DemoError(f"no probe went through the engine within 120 s: read {work / 'demo.log'} and the broker's "
                    f"logs under {work / 'rocketmq'}, then run the demo again")


def run_demo(duration: float = 30.0, rate: int = 200, as_json: bool = False, max_delay_s: float | None = None,
             console: Console | None = None) -> dict[str, object]:
    """Run the whole demo; returns (and with as_json prints last) the summary. DemoError before anything
    starts when `duration` or `rate` is out of range."""
    _check_inputs(duration, rate)
    console = console or Console(stderr=as_json)
    max_delay_s = max_delay_s if max_delay_s is not None else min(180.0, max(2.0, 2 * duration))
    state = DemoState()
    rng = random.Random(7)
    work = Path(tempfile.mkdtemp(prefix="timewheel-demo-"))
    with _logs_to(work / "demo.log"):
        console.print(f"log lines go to {work / 'demo.log'}")
        summary = _run(work, duration, rate, max_delay_s, state, rng, console)
    if as_json:
        sys.stdout.write(json.dumps(summary) + "\n")
        sys.stdout.flush()
    else:
        console.print(_verdict(summary), highlight=False)
    return summary


@contextmanager
def _logs_to(path: Path) -> Iterator[None]:
    """Send every log line to `path` while the demo runs: lines written to the terminal would tear the live view."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        handler.close()


def _verdict(summary: Mapping[str, object]) -> str:
    """The demo's last line: where every message went."""
    late: Mapping[str, float] = summary["lateness_ms"]  # type: ignore[assignment]
    head = "every message accounted for" if not summary["lost"] else f"{summary['lost']:,} messages LOST"
    return (f"{head}: {summary['sent_valid']:,} valid sent = {summary['delivered']:,} delivered "
            f"+ {summary['cancelled']:,} cancelled + {summary['lost']:,} lost; {summary['contract_breaking_sent']:,} "
            f"contract-breaking sent, {summary['dead_lettered']:,} dead-lettered; {summary['duplicates']:,} duplicates;"
            f" lateness p50 {late['p50']:.1f} ms, p99 {late['p99']:.1f} ms (--json for the full summary)")


def _run(work: Path, duration: float, rate: int, max_delay_s: float, state: DemoState, rng: random.Random,
         console: Console) -> dict[str, object]:
    """Start everything, produce for `duration` seconds, drain, stop everything; the summary."""
    from forwarder import LocalRocketMQ
    from forwarder._rmq_native import LogLevel, NativeProducer, NativePushConsumer
    from forwarder.rocketmq import OutgoingMessage, ReceivedMessage

    console.print("starting a local RocketMQ (the first run downloads it from Maven Central) ...")
    mq = LocalRocketMQ(work / "rocketmq", stop_timeout=5.0)
    mq.start()
    cfg = RocketMQConfig(namesrv=mq.namesrv_addr)
    mq.create_topics([cfg.delay_topic, cfg.dead_letter_topic, *TOPICS])
    settings = Settings(engine=EngineConfig(work / "data", max_delay_ms=int(max_delay_s * 2000)), rocketmq=cfg,
                        admin=AdminConfig(listen="127.0.0.1:0"))
    service = Service(settings).start()
    assert service.admin is not None
    console.print(f"engine up; metrics at http://{service.admin.address}/metrics")

    def on_message(msg: ReceivedMessage) -> bool:
        now = time.time_ns() // 1_000_000
        orig = msg.properties.get("TW_ORIGINAL_MSG_ID", msg.msg_id)
        orig = orig.split(":", 1)[0] if msg.topic != cfg.dead_letter_topic else orig
        with state.lock:
            if msg.topic == cfg.dead_letter_topic:
                state.dead_lettered_ids.add(orig)
                return True
            if orig in state.delivered_ids:
                state.duplicates += 1
                return True
            state.delivered_ids.add(orig)
            due = int(msg.properties.get("TW_DUE_MS", now))
            state.lateness.record_value(max(0, now - due) * 1000)
        return True

    consumer = NativePushConsumer("timewheel-demo-consumer", mq.namesrv_addr, on_message, log_level=LogLevel.ERROR)
    for t in (*TOPICS, cfg.dead_letter_topic):
        consumer.subscribe(t)
    consumer.start()
    producer = NativeProducer("timewheel-demo-producer", mq.namesrv_addr, log_level=LogLevel.ERROR)
    producer.start()
    stop_producing = threading.Event()
    _warm_up(producer, cfg, state, console, work)

    def produce() -> None:
        n = 0
        start = time.monotonic()
        while not stop_producing.is_set() and time.monotonic() - start < duration:
            n += 1
            now = time.time_ns() // 1_000_000
            if n % 97 == 0:  # breaks the contract: no target topic
                if _send(producer, OutgoingMessage(cfg.delay_topic, b"no target", None, None,
                                                   {"TW_DELAY_MS": "1000"}), state) is not None:
                    with state.lock:
                        state.sent_bad += 1
            else:
                topic = rng.choice(TOPICS)
                delay = int(rng.choice([rng.uniform(1, 10), rng.uniform(1, max_delay_s)]) * 1000)
                order = f"order-{n}"
                res = _send(producer, OutgoingMessage(cfg.delay_topic, f"{topic} {order}".encode(), f"t{n % 3}",
                                                      order, {"TW_TARGET_TOPIC": topic,
                                                              "TW_DELIVER_AT_MS": str(now + delay)}), state)
                if res is None:
                    continue
                with state.lock:
                    state.sent += 1
                    state.valid_ids.add(res.msg_id)
                    state.last_due_ms = max(state.last_due_ms, now + delay)
                if n % 20 == 0 and delay > 3000:  # the customer paid: cancel the timeout by its key
                    time.sleep(0.2)  # let ingest store it first
                    assert service.engine is not None
                    c = service.engine.cancel(key=order)
                    with state.lock:
                        state.cancel_requested += 1
                        state.cancelled += c
            time.sleep(max(0.0, start + n / rate - time.monotonic()))

    threading.Thread(target=produce, name="demo-producer", daemon=True).start()
    summary: dict[str, object]
    try:
        with _View(console, state, service) as view:
            t0 = time.monotonic()
            while time.monotonic() - t0 < duration:
                view.update(f"producing ({time.monotonic() - t0:.0f}/{duration:.0f} s)")
                time.sleep(0.25)
            stop_producing.set()
            # drain: wait for the last due message, then for stragglers
            while True:
                with state.lock:
                    outstanding = state.sent - state.cancelled - len(state.delivered_ids & state.valid_ids)
                    last_due = state.last_due_ms
                now = time.time_ns() // 1_000_000
                if outstanding <= 0 or now > last_due + 30_000:
                    break
                view.update(f"draining ({outstanding} left, last due in {max(0, last_due - now) / 1000:.0f} s)")
                time.sleep(0.25)
            time.sleep(1.0)  # a late duplicate would show here
            view.update("done", final=True)
        with state.lock:
            delivered = len(state.delivered_ids & state.valid_ids)
            lost = state.sent - state.cancelled - delivered
            summary = {"sent": state.sent + state.sent_bad, "sent_valid": state.sent, "delivered": delivered,
                       "cancelled": state.cancelled, "dead_lettered": len(state.dead_lettered_ids),
                       "contract_breaking_sent": state.sent_bad, "duplicates": state.duplicates, "lost": lost,
                       "producer_send_errors": state.send_errors,
                       "lateness_ms": state.lateness_ms(), "engine": {k: v for k, v in service.stats().items()
                                                                       if isinstance(v, (int, float))}}
    finally:
        stop_producing.set()
        producer.shutdown()
        # not destroyed: a consume thread still returning from its callback would abort the process
        consumer.shutdown(destroy=False)
        service.stop()
        mq.stop()
    return summary
