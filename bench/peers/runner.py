"""The workloads (steady, burst, horizon) and the run that drives every system through them."""
from __future__ import annotations

import os
import platform
import re
import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from bench.peers.cpu import cpu_seconds, thread_readings, threads_between
from bench.peers.common import BenchMessage, Recorder, load_average, now_ms, percentiles, remove_tree
from bench.peers.java_workloads import run_intake_ceiling, run_noop_consumer, run_steady_java
from bench.peers.systems import (DAY_MS, Heap, PlainHop, Postgres, RedisZset, RocketMQLevels, RocketMQTimer, Sink,
                                 System, Timewheel)

#: The reference rows (the broker's own floor), then every system, in the order they run.
REFERENCES = ("plain-hop", "intake-ceiling", "noop-consumer")
ALL_SYSTEMS = (*REFERENCES, "timewheel", "rocketmq-timer", "rocketmq-levels", "redis-zset", "postgres", "heapq")
_QUANTILES = np.linspace(0, 100, 1001)
#: how often the batch ingest phase reads the engine's counter: a /metrics answer costs the engine a few
#: milliseconds of CPU under that load, under its interpreter lock, beside the ingest thread it measures
_STORED_SAMPLE_S = 0.25


@dataclass(frozen=True)
class RunConfig:
    """The workloads' sizes; field names are the `run` command's flags."""

    systems: tuple[str, ...] = ALL_SYSTEMS
    steady_rate: int = 1000
    steady_seconds: float = 30.0
    steady_high_rate: int = 10_000
    steady_high_seconds: float = 20.0
    steady_high_warm_up_s: float = 5.0
    delay_min_ms: int = 1000
    delay_max_ms: int = 10_000
    burst: int = 20_000
    burst_lead_s: float = 15.0
    horizon_messages: int = 1_000_000
    horizon_broker_messages: int = 100_000
    horizon_days: float = 30.0
    probes: int = 100
    body_bytes: int = 100
    senders: int = 8
    poll_ms: float = 10.0
    intake_seconds: int = 10
    intake_threads: int = 4
    intake_batch: int = 128
    pull_batch: int = 32
    seed: int = 7
    broker_per_system: bool = True
    stages: str = ""
    broker_logs: str = ""
    engine_tree: str = ""


class Ids:
    """Unique message ids across every phase of a system."""

    def __init__(self) -> None:
        self.next = 1

    def take(self, n: int) -> np.ndarray:
        """The next `n` ids."""
        out = np.arange(self.next, self.next + n, dtype=np.int64)
        self.next += n
        return out


def _lateness(rec: Recorder) -> dict[str, object]:
    """Percentiles and 1001 quantiles (for the chart) of a phase's lateness."""
    late = rec.lateness_ms()
    out: dict[str, object] = {"lateness_ms": percentiles(late), "duplicates": rec.duplicates}
    if len(late):
        out["quantiles_ms"] = [round(float(x), 2) for x in np.percentile(late, _QUANTILES)]
    return out


def _body(rng: np.random.Generator, n: int) -> bytes:
    """A random (incompressible) body: a compressing store must not look cheaper than it is."""
    return rng.bytes(n)


def _send_delayed(system: System, msg_ids: np.ndarray, delays: np.ndarray, body: bytes) -> int:
    """Send messages due `delays` ms after now, now being when a sender thread takes the batch up
    (a producer asks for a delay from the moment it sends, however long it queued before)."""
    base = now_ms()
    return system.send([BenchMessage(int(i), base + int(d), body) for i, d in zip(msg_ids, delays)])


def run_steady(system: System, sink: Sink, cfg: RunConfig, ids: Ids, rng: np.random.Generator,
               pool: ThreadPoolExecutor, rate: int | None = None, seconds: float | None = None) -> dict[str, object]:
    """A producer paced at `rate` (default `steady_rate`) for `seconds` (default `steady_seconds`);
    each message due a random delay later."""
    rate = rate or cfg.steady_rate
    seconds = seconds or cfg.steady_seconds
    n = int(rate * seconds)
    msg_ids = ids.take(n)
    delays = rng.integers(cfg.delay_min_ms, cfg.delay_max_ms + 1, n)
    body = _body(rng, cfg.body_bytes)
    rec = Recorder()
    sink.current = rec
    futures = []
    t0 = time.monotonic()
    sent = 0
    tick = 0.01
    while sent < n:
        upto = min(n, int((time.monotonic() - t0) * rate) + 1)
        if upto > sent:
            futures.append(pool.submit(_send_delayed, system, msg_ids[sent:upto], delays[sent:upto], body))
            sent = upto
        time.sleep(max(0.0, t0 + (sent / rate) - time.monotonic(), tick / 4))
    accepted = sum(f.result() for f in futures)
    produce_s = time.monotonic() - t0
    system.wait_stored(accepted, 120)
    wait_s = cfg.delay_max_ms / 1000 + system.extra_wait_s + 60
    complete = rec.wait_count(accepted, wait_s, idle=20)
    return {"rate": rate, "messages": n, "accepted": accepted, "received": rec.count, "complete": complete,
            "producer_rate": round(accepted / produce_s), **_lateness(rec)}


def run_burst(system: System, sink: Sink, cfg: RunConfig, ids: Ids, rng: np.random.Generator,
              pool: ThreadPoolExecutor) -> dict[str, object]:
    """`burst` messages all due at the same millisecond, sent as fast as the senders go."""
    n = cfg.burst
    body = _body(rng, cfg.body_bytes)
    due = now_ms() + int(cfg.burst_lead_s * 1000)
    msgs = [BenchMessage(int(i), due, body) for i in ids.take(n)]
    rec = Recorder()
    sink.current = rec
    t0 = time.perf_counter()
    accepted = sum(pool.map(system.send, [msgs[i:i + 200] for i in range(0, n, 200)]))
    ack_s = time.perf_counter() - t0
    stored, stored_at = system.wait_stored(accepted, 300)
    stored_s = stored_at - t0
    overran_ms = round(now_ms() - (time.perf_counter() - stored_at) * 1000 - due)
    time.sleep(max(0.0, (due - now_ms()) / 1000))
    complete = rec.wait_count(accepted, 300 + system.extra_wait_s, idle=30 + system.extra_wait_s)
    last = rec.last_ns()
    return {"messages": n, "accepted": accepted, "received": rec.count, "complete": complete,
            "stored": stored, "ingest_ack_per_s": round(accepted / ack_s),
            "ingest_stored_per_s": round(stored / stored_s) if stored_s > 0 else None,
            "stored_before_due": overran_ms < 0,
            "ingest_overran_due_ms": max(0, overran_ms),
            "all_received_after_due_ms": round(last / 1e6 - due, 1) if last else None, **_lateness(rec)}


def run_horizon(system: System, sink: Sink, cfg: RunConfig, ids: Ids, rng: np.random.Generator) -> dict[str, object]:
    """Pending messages spread over days: memory per pending message, then a restart with probes due."""
    n = system.horizon_count or cfg.horizon_messages
    span = int(cfg.horizon_days * DAY_MS)
    capped = system.max_delay_ms is not None and span > system.max_delay_ms
    if capped:
        span = int(system.max_delay_ms)  # type: ignore[arg-type]
    body = _body(rng, cfg.body_bytes)
    start = now_ms() + 120_000
    hid = ids.take(n)
    dues = start + rng.integers(0, max(1, span - 120_000), n) if span > 120_000 else np.full(n, now_ms() + span)
    sink.current = Recorder(wanted=[])  # horizon messages are not waited for
    before = system.memory()
    t0 = time.perf_counter()
    path = system.prefill(hid, dues.astype(np.int64), body)
    prefill_s = time.perf_counter() - t0
    time.sleep(3.0)  # let asynchronous work (timer log enqueue, flushes) settle
    loaded = system.memory()
    # probes: due while the system is down
    probe_ids = ids.take(cfg.probes)
    rec = Recorder(wanted=probe_ids.tolist())
    sink.current = rec
    probe_due = now_ms() + system.probe_delay_ms
    system.send([BenchMessage(int(i), probe_due, body) for i in probe_ids])
    system.wait_stored(cfg.probes, 60)
    t_stop = time.perf_counter()
    system.stop_for_restart()
    stop_s = time.perf_counter() - t_stop
    early = rec.count
    time.sleep(max(0.0, (probe_due - now_ms()) / 1000 + 0.5))
    t_start = time.time_ns()
    first_ns = system.start_after_stop()
    start_call_s = (time.time_ns() - t_start) / 1e9
    if first_ns is None:
        rec.wait_count(1, 300)
        first_ns = rec.first_ns()
    rec.wait_count(cfg.probes, 60, idle=20)
    time.sleep(2.0)
    restarted = system.memory()
    out: dict[str, object] = {
        "pending": n, "span_days": round(span / DAY_MS, 3), "capped_by_system": capped, "prefill": path,
        "prefill_s": round(prefill_s, 1), "prefill_per_s": round(n / prefill_s),
        "memory": system.memory_figures(before, loaded, restarted, n),
        "samples": {"before": asdict(before), "loaded": asdict(loaded), "restarted": asdict(restarted)},
        "restart": {"probes": cfg.probes, "stop_s": round(stop_s, 2), "start_call_s": round(start_call_s, 2),
                    "received_before_restart": early,
                    "first_delivery_s": round((first_ns - t_start) / 1e9, 3) if first_ns else None,
                    "probes_received": rec.count},
    }
    if early:
        out["restart"]["warning"] = "probes arrived before the stop finished: the stop took longer than the probe delay"  # type: ignore[index]
    return out


def run_batch_ingest(system: Timewheel, cfg: RunConfig) -> dict[str, object]:
    """The intake ceiling's Java producer sending delay messages (due in a day) to the engine's delay topic:
    the rate at which the engine stores what batching producers send, sampled from its `scheduled` counter."""
    import threading

    from forwarder.java_client import JavaClient

    java = JavaClient(system.mq.namesrv_addr)
    base = int(system.metrics().get("timewheel_scheduled_total", 0))
    sent: dict[str, float] = {}
    props = {"TW_TARGET_TOPIC": system.out_topic, "TW_DELAY_MS": str(DAY_MS)}
    sender = threading.Thread(target=lambda: sent.update(java.intake(
        system.delay_topic, seconds=cfg.intake_seconds, threads=cfg.intake_threads, batch=cfg.intake_batch,
        body_size=cfg.body_bytes, props=props)), daemon=True)
    sender.start()
    samples: list[tuple[float, int]] = []
    still_since = time.monotonic()
    producer_done: tuple[float, int] | None = None  # when the producer finished, and what was stored then
    while True:
        got = int(system.metrics().get("timewheel_scheduled_total", 0)) - base
        t = time.perf_counter()
        if not samples or got != samples[-1][1]:
            samples.append((t, got))
            still_since = time.monotonic()
        done = not sender.is_alive()
        if done and producer_done is None:
            producer_done = (t, got)
        if done and (got >= int(sent.get("sent", 0)) or time.monotonic() - still_since > 10):
            break
        time.sleep(_STORED_SAMPLE_S)
    sender.join()
    moving = [(t, n) for t, n in samples if n > 0]
    stored = samples[-1][1]
    rate = None
    if len(moving) >= 2 and moving[-1][0] > moving[0][0]:
        rate = round((moving[-1][1] - moving[0][1]) / (moving[-1][0] - moving[0][0]))
    # After the producer stopped, the engine reads the rest of the backlog with the machine to itself and
    # the broker: what the no-op consumer row measures (it reads a backlog filled before it starts).
    alone = None
    if producer_done is not None:
        after = [(t, n) for t, n in samples if t >= producer_done[0]]
        if len(after) >= 2 and after[-1][1] - after[0][1] >= 100_000:
            alone = round((after[-1][1] - after[0][1]) / (after[-1][0] - after[0][0]))
    return {"sent": int(sent.get("sent", 0)), "producer_rate": round(sent.get("rate", 0)), "stored": stored,
            "stored_per_s": rate, "threads": cfg.intake_threads, "batch": cfg.intake_batch,
            "backlog_at_producer_end": None if producer_done is None else int(sent.get("sent", 0)) - producer_done[1],
            "stored_per_s_backlog_alone": alone}


def _machine() -> dict[str, object]:
    """Where and when."""
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
            "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def run(cfg: RunConfig, command: str, log: Callable[[str], None] = print) -> dict[str, object]:
    """Run every selected system through steady, burst and horizon; return the results document."""
    out: dict[str, object] = {"command": command, "config": asdict(cfg), "machine": _machine(),
                              "load_average_start": load_average(), "systems": {}}
    work = Path(tempfile.mkdtemp(prefix="peers-bench-"))
    # A broker of its own for each system by default: what one system leaves (the intake rows fill it
    # with millions of messages) must not move the next one's figures, the broker's CPU among them.
    out["rocketmq"] = {"broker_per_system": cfg.broker_per_system}
    broker: _Broker | None = None
    try:
        for name in cfg.systems:
            if broker is None and name.startswith(("timewheel", "rocketmq", "plain", "intake", "noop")):
                log("starting the local RocketMQ ...")
                broker = _Broker(work / (f"mq-{name}" if cfg.broker_per_system else "mq"))
            mq, producer = (broker.mq, broker.producer) if broker is not None else (None, None)
            try:
                if name in _BROKER_ROWS:
                    out["systems"][name] = _run_broker_row(name, cfg, mq, log)  # type: ignore[index]
                else:
                    out["systems"][name] = _run_system(name, cfg, work, mq, producer, log)  # type: ignore[index]
            finally:
                if broker is not None and cfg.broker_per_system:
                    stopping, broker = broker, None
                    stopping.stop()
                    if cfg.broker_logs:
                        keep_broker_logs(stopping.root, Path(cfg.broker_logs) / name)
                    # its store goes too: the intake rows leave gigabytes of dirty pages, whose writeback
                    # would go on under the next system's phases
                    remove_tree(stopping.root)
    finally:
        if broker is not None:
            broker.stop()
            if cfg.broker_logs:
                keep_broker_logs(broker.root, Path(cfg.broker_logs) / "shared")
        remove_tree(work)
    out["load_average_end"] = load_average()
    return out


def keep_broker_logs(root: Path, dest: Path) -> int:
    """Copy the logs a local RocketMQ under `root` wrote (its NameServer's and brokers', `*.log` in
    each logs/rocketmqlogs) to `dest`, before the store goes; how many files."""
    n = 0
    for logs in sorted(root.rglob("rocketmqlogs")):
        for f in sorted(logs.glob("*.log")):
            target = dest / logs.relative_to(root).parent.parent / f.name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, target)
            n += 1
    return n


class _Broker:
    """A local RocketMQ and the native producer the systems send through, started in `root`."""

    def __init__(self, root: Path) -> None:
        from forwarder import LocalRocketMQ
        from forwarder._rmq_native import LogLevel, NativeProducer

        self.root = root
        self.mq = LocalRocketMQ(root, stop_timeout=20.0)
        self.mq.start()
        self.producer: NativeProducer | None = None
        try:
            self.producer = NativeProducer("peers-producer", self.mq.namesrv_addr, log_level=LogLevel.ERROR)
            self.producer.start()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop the producer, then the broker and its NameServer."""
        try:
            if self.producer is not None:
                self.producer.shutdown()
        finally:
            self.mq.stop()


def _make(name: str, sink: Sink, cfg: RunConfig, work: Path, mq: object, producer: object) -> System:
    """The adapter for `name`."""
    d = work / name
    d.mkdir(parents=True, exist_ok=True)
    if name == "plain-hop":
        return PlainHop(sink, d, mq, producer)  # type: ignore[arg-type]
    if name == "timewheel":
        return Timewheel(sink, d, mq, producer, Path(cfg.stages) if cfg.stages else None,  # type: ignore[arg-type]
                         Path(cfg.engine_tree) if cfg.engine_tree else None)
    if name == "rocketmq-timer":
        s: System = RocketMQTimer(sink, d, mq, producer)  # type: ignore[arg-type]
        s.horizon_count = cfg.horizon_broker_messages
        return s
    if name == "rocketmq-levels":
        s = RocketMQLevels(sink, d, mq, producer)  # type: ignore[arg-type]
        s.horizon_count = cfg.horizon_broker_messages
        return s
    if name == "redis-zset":
        return RedisZset(sink, d, poll_ms=cfg.poll_ms)
    if name == "postgres":
        return Postgres(sink, d, poll_ms=cfg.poll_ms)
    if name == "heapq":
        return Heap(sink, d)
    raise ValueError(f"unknown system {name!r}: choose from {', '.join(ALL_SYSTEMS)}")


def _warm_up(system: System, sink: Sink, ids: Ids, cfg: RunConfig) -> float:
    """Send a few messages due in 1 s until they arrive (routes, rebalance, connections settle)."""
    t0 = time.monotonic()
    for _ in range(10):
        rec = Recorder()
        sink.current = rec
        due = now_ms() + 1000
        n = system.send([BenchMessage(int(i), due, b"w" * cfg.body_bytes) for i in ids.take(20)])
        if n and rec.wait_count(n, 20):
            return round(time.monotonic() - t0, 1)
    raise RuntimeError(f"{system.name}: warm-up messages did not arrive within {time.monotonic() - t0:.0f} s")


def _run_system(name: str, cfg: RunConfig, work: Path, mq: object, producer: object,
                log: Callable[[str], None]) -> dict[str, object]:
    """One system through every workload; a failure is recorded and the run goes on."""
    sink = Sink()
    ids = Ids()
    rng = np.random.default_rng(cfg.seed)
    result: dict[str, object] = {"load_average_before": load_average()}
    system = _make(name, sink, cfg, work, mq, producer)
    pool = ThreadPoolExecutor(cfg.senders, thread_name_prefix=f"send-{name}")
    try:
        log(f"[{name}] starting")
        system.open()
        result["warm_up_s"] = _warm_up(system, sink, ids, cfg)
        workloads: dict[str, Callable[[], dict[str, object]]] = {
            "steady": lambda: run_steady(system, sink, cfg, ids, rng, pool),
            "steady_high": lambda: run_steady_java(system, sink, cfg, ids),
            "burst": lambda: run_burst(system, sink, cfg, ids, rng, pool),
            "horizon": lambda: run_horizon(system, sink, cfg, ids, rng),
            "batch_ingest": lambda: run_batch_ingest(system, cfg),  # type: ignore[arg-type]
        }
        for phase in system.phases:
            if _given_zero(phase, system, cfg):
                log(f"[{name}] {phase}: skipped, its size is 0")
                continue
            fn = workloads[phase]
            log(f"[{name}] {phase} ...")
            t0 = time.monotonic()
            cpu0, threads0 = cpu_seconds(system), thread_readings(system)
            try:
                result[phase] = fn()
            except Exception as e:  # noqa: BLE001 - one failed phase must not lose the others
                result[phase] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
            result[phase]["seconds"] = round(time.monotonic() - t0, 1)  # type: ignore[index]
            cpu1 = cpu_seconds(system)
            result[phase]["server_cpu_s"] = {k: round(v - cpu0.get(k, 0.0), 2)  # type: ignore[index]
                                             for k, v in cpu1.items()}
            # by thread id: a thread named during the phase is charged only what it did after
            threads = threads_between(threads0, thread_readings(system))
            if threads:
                result[phase]["engine_threads_cpu_s"] = {  # type: ignore[index]
                    k: round(v, 3) for k, v in sorted(threads.items()) if v > 0}
            try:
                diag = system.diagnostics()
            except Exception as e:  # noqa: BLE001
                diag = {"error": str(e)}
            if diag:
                result[phase]["diagnostics"] = diag  # type: ignore[index]
            log(f"[{name}] {phase}: {_summary(result[phase])}")  # type: ignore[arg-type]
    except Exception as e:  # noqa: BLE001
        result["error"] = f"{type(e).__name__}: {e}"
        result["trace"] = traceback.format_exc()[-2000:]
        log(f"[{name}] failed: {result['error']}")
    finally:
        sink.current = None
        try:
            system.close()
        except Exception as e:  # noqa: BLE001
            result.setdefault("close_error", f"{type(e).__name__}: {e}")
        pool.shutdown(wait=True)
    result["notes"] = system.notes
    result["load_average_after"] = load_average()
    return result


def _given_zero(phase: str, system: System, cfg: RunConfig) -> bool:
    """Whether the flags gave `phase` no messages or no time, so that running it would measure nothing."""
    sizes = {"steady": cfg.steady_rate * cfg.steady_seconds,
             "steady_high": cfg.steady_high_rate * cfg.steady_high_seconds,
             "burst": cfg.burst,
             "horizon": system.horizon_count or cfg.horizon_messages,
             "batch_ingest": cfg.intake_seconds}
    return sizes.get(phase, 1) <= 0


#: The reference rows measuring the broker alone with RocketMQ's Java clients: (result key, what, how).
_BROKER_ROWS = {
    "intake-ceiling": ("intake", "RocketMQ's Java producer, batches", run_intake_ceiling),
    "noop-consumer": ("read", "a backlog read by RocketMQ's Java lite pull consumer doing nothing", run_noop_consumer),
}


def _run_broker_row(name: str, cfg: RunConfig, mq: object, log: Callable[[str], None]) -> dict[str, object]:
    """A reference row of `_BROKER_ROWS`; a failure is recorded and the run goes on."""
    key, what, fn = _BROKER_ROWS[name]
    result: dict[str, object] = {"load_average_before": load_average()}
    log(f"[{name}] {what} ...")
    try:
        result[key] = fn(mq, cfg)
        log(f"[{name}] {result[key]}")
    except Exception as e:  # noqa: BLE001
        result["error"] = f"{type(e).__name__}: {e}"
        log(f"[{name}] failed: {result['error']}")
    result["load_average_after"] = load_average()
    return result


def _summary(phase: dict[str, object]) -> str:
    """One line of a phase's result for the console."""
    if "error" in phase:
        return f"ERROR {phase['error']}"
    keep = ("rate", "received", "accepted", "producer_rate", "ingest_stored_per_s", "stored_per_s", "lateness_ms",
            "memory", "restart",
            "prefill_per_s")
    return " ".join(f"{k}={phase[k]}" for k in keep if k in phase)


def run_fast_switch(cfg: RunConfig, command: str) -> dict[str, object]:
    """run() with a short GIL switch interval, so the client library's callbacks, the pollers and the
    release thread wake up promptly (as `timewheel.app.service` does for the engine)."""
    import sys

    previous = sys.getswitchinterval()
    sys.setswitchinterval(0.0005)
    try:
        return run(cfg, command)
    finally:
        sys.setswitchinterval(previous)
