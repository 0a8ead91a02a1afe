"""Capacity model: disk, memory and CPU per million scheduled messages and per thousand due per
second, measured on this machine, and how many engines a load needs.

    python -m bench.capacity [--messages 50000] [--due-rate 10000] [--low-due-rate 1000]
        [--check-rate 2000 --check-rate 5000] [--loaded 500000] [--ha]

- ingest: a `timewheel serve` process on a real local RocketMQ stores --messages delay messages
  (200-byte bodies) due in two hours; its CPU time (from /proc, idle cost subtracted) per message,
  and of that its kernel (system) time, and the data directory's bytes per message once checkpointed;
- delivery: messages come due for 10 s at --due-rate a second, then at --low-due-rate, then at each
  --check-rate; CPU time per delivered message at each;
- with --ha, the engine runs as a replica set of one (`[ha]` on a local ZooKeeper, the lease taken
  before anything is measured): the fenced sink, the watermark and the look-ups a replica runs;
- loaded memory: a fresh process opens a data directory holding --loaded messages due within the
  loaded segments; RSS growth per message, and the wheel's own bytes per entry.

Delivery CPU is not linear in the due rate: each send costs about as much as tens of messages, and
the send linger (`rocketmq.send_linger_ms` growing to `send_linger_max_ms` at 10,000 due a second)
decides how many messages a send carries. The model fits a cost per send and a cost per message to
the two delivery rates (`delivery_fit`), with a send carrying the messages due over the linger plus
the millisecond the timer turns in; the check rates are measured beside what that fit predicts for
them, so its error is on record. The model (per million, per thousand a second, engines for
example loads) is computed from those figures. Writes bench/results/capacity.json.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable, Sequence


from bench.engine_latency import _machine
from bench.rocketmq_e2e import RemoteReceiver, lateness_summary, produce
from bench.forwarder_client_throughput import CpuMeter
from bench.peers.common import not_a_checkout, process_cpu_seconds
from coordination import LocalZooKeeper
from forwarder import LocalRocketMQ
from forwarder.rocketmq import OutgoingMessage
from forwarder.rocketmq import RemotingProducer
from storage import SegmentLayout, summarize
from storage.audit import data_dir_bytes
from tests.ports import free_port
from tests.reliability.kill_loop import serve_env, start_serve
from forwarder.config import RocketMQConfig
from timewheel.app.settings import load_settings
from timewheel.app.status import StatusError, fetch_status
from timewheel.config import EngineConfig
from timewheel.dispatch_queue import FULL_LINGER_RATE, linger_for_rate

RESULTS = Path(__file__).parent / "results"
CORE_BUDGET = 0.7  # of one core per engine: one Python process, the GIL serialises its Python work
DUE_SECONDS = 10.0
BODY = b"x" * 200


def _system_seconds(pid: int) -> float:
    """CPU seconds process `pid` has spent in the kernel (its system time): the socket, file and
    futex calls, which no change to the engine's Python takes away."""
    return process_cpu_seconds(pid)[1]


def _rss_bytes(pid: int | str = "self") -> int:
    """Resident set size of a process."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def holds_lease(admin: str, said: list[str] | None = None) -> bool:
    """Whether the engine at `admin` (HOST:PORT) says, on its GET /status, that its replica holds the lease.
    One that does not answer it yet (starting, or an HTTP error) does not: what went wrong is appended to
    `said`, for the caller to show if it never takes the lease."""
    try:
        doc = fetch_status(admin)
    except StatusError as e:
        if said is not None:
            said.append(str(e))
        return False
    replica = (doc.get("ha") or {}).get("replica") or {}
    return replica.get("holder") is True


def _wait(predicate: Callable[[], bool], timeout: float) -> bool:
    """Poll every 0.2 s (reading the index sidecars is not free) until true or `timeout`."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _stored(data_dir: Path) -> int:
    """Records on disk, read from the index sidecars (safe beside a live engine)."""
    try:
        return int(summarize(SegmentLayout.open_existing(data_dir))["totals"]["records"])  # type: ignore[index]
    except Exception:  # the engine has not created the directory yet
        return 0


class _NullSink:
    """Accepts every send: the loaded-memory measure stops before anything is due."""

    def send_batch(self, messages: Sequence[object]) -> list[bool]:
        return [True] * len(messages)


def _fill_loaded(data_dir: str, n: int) -> None:
    """Child process: schedule `n` messages due 5-10 minutes from now (inside the loaded segments)."""
    from timewheel import Engine, Message
    now = time.time_ns() // 1_000_000
    with Engine(EngineConfig(Path(data_dir), preload_seconds=900), _NullSink()) as engine:
        for start in range(0, n, 10_000):
            engine.schedule([Message("CAP", BODY, now + 300_000 + (start + i) % 300_000)
                             for i in range(min(10_000, n - start))])


def _open_loaded(data_dir: str, out: "multiprocessing.Queue[dict[str, float]]") -> None:
    """Child process: RSS growth of opening a data directory whose messages are all in the wheel."""
    from timewheel import Engine
    import numpy  # noqa: F401  (imported before the baseline: its own memory is not the wheel's)
    rss0 = _rss_bytes()
    engine = Engine(EngineConfig(Path(data_dir), preload_seconds=900), _NullSink()).start()
    try:
        time.sleep(1.0)
        st = engine.stats()
        out.put({"entries": float(st.wheel_entries), "wheel_bytes": float(st.wheel_bytes),
                 "rss_growth": float(_rss_bytes() - rss0)})
    finally:
        engine.stop()


def _loaded_once(n: int, data: str) -> dict[str, float]:
    ctx = multiprocessing.get_context("spawn")
    p = ctx.Process(target=_fill_loaded, args=(data, n))
    p.start()
    p.join()
    q: multiprocessing.Queue[dict[str, float]] = ctx.Queue()
    p = ctx.Process(target=_open_loaded, args=(data, q))
    p.start()
    got = q.get(timeout=300)
    p.join()
    return got


def loaded_memory(n: int, work: Path) -> dict[str, float]:
    """Bytes per message in the wheel: open data directories of n/5 and n loaded messages in fresh
    processes; the slope between the two leaves out what opening an engine costs anyway."""
    small, large = _loaded_once(n // 5, str(work / "loaded-small")), _loaded_once(n, str(work / "loaded"))
    entries = max(1.0, large["entries"] - small["entries"])
    return {"messages": n, "wheel_entries": int(large["entries"]),
            "wheel_bytes_per_entry": round(large["wheel_bytes"] / max(1.0, large["entries"]), 1),
            "rss_bytes_per_entry": round((large["rss_growth"] - small["rss_growth"]) / entries, 1),
            "rss_mb_fixed": round((large["rss_growth"] - (large["rss_growth"] - small["rss_growth"]) / entries
                                   * large["entries"]) / 2**20, 1)}


class Profile:
    """py-spy sampling a process into `path` (collapsed stacks) while the block runs; nothing if no path.

    With `gil`, only samples of the thread holding the GIL are kept: their count over `rate` times
    the seconds sampled (`gil_share`) is the share of the time some thread held it.
    """

    RATE = 250

    def __init__(self, pid: int, path: Path | None, *, gil: bool = False) -> None:
        self.pid, self.path, self.gil = pid, path, gil
        self.proc: subprocess.Popen[bytes] | None = None
        self.seconds = 0.0

    def __enter__(self) -> "Profile":
        if self.path is not None:
            # the one installed beside this interpreter (the project's environment), else the PATH's
            beside = Path(sys.executable).with_name("py-spy")
            self.proc = subprocess.Popen([str(beside) if beside.exists() else "py-spy", "record", "--pid", str(self.pid),
                                          "--rate", str(self.RATE), "--nonblocking", "--format", "raw", "--output", str(self.path),
                                          *(["--gil"] if self.gil else [])],
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # attached before the measured work starts
            self.seconds = -time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.seconds += time.monotonic()
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(60)

    def gil_share(self) -> float | None:
        """Share of the sampled time a thread held the GIL (a `gil` profile only)."""
        if not self.gil or self.path is None or not self.path.exists() or self.seconds <= 0:
            return None
        samples = sum(int(line.rpartition(" ")[2]) for line in self.path.read_text().splitlines() if line.strip())
        return round(samples / (self.RATE * self.seconds), 3)


def through_rocketmq(messages: int, due_rate: int, work: Path, profile: Path | None = None,
                     gil: bool = False, serve_extra: dict[str, str] | None = None,
                     other_rates: Sequence[int] = (), ha: bool = False,
                     engine_tree: Path | None = None) -> dict[str, object]:
    """Ingest and delivery CPU of a `timewheel serve` process, and its disk per message: delivery
    at `due_rate` (`delivery`), then at each of `other_rates` (`delivery_R`); with `ha`, the engine
    is a replica set of one on a local ZooKeeper, holding the lease before anything is measured;
    with `engine_tree`, the engine is that checkout's (another revision's)."""
    out: dict[str, object] = {}
    with contextlib.ExitStack() as stack:
        mq = stack.enter_context(LocalRocketMQ(work / "mq", stop_timeout=3.0))
        if ha:
            zk = stack.enter_context(LocalZooKeeper(work / "zk"))
            serve_extra = {"TIMEWHEEL_HA_ZOOKEEPER": zk.connect_string, "TIMEWHEEL_HA_REPLICA_ID": "capacity",
                           **(serve_extra or {})}
        _measure(mq, out, messages, due_rate, work, profile, gil, serve_extra, other_rates, ha, engine_tree)
    return out


def _measure(mq: LocalRocketMQ, out: dict[str, object], messages: int, due_rate: int, work: Path,
             profile: Path | None, gil: bool, serve_extra: dict[str, str] | None, other_rates: Sequence[int],
             ha: bool, engine_tree: Path | None = None) -> None:
    """`through_rocketmq` on a started broker (and ZooKeeper): its figures into `out`."""
    run = uuid.uuid4().hex[:8]
    delay_topic, target = f"TW_DELAY_{run}", f"CAP_{run}"
    mq.create_topics([delay_topic, f"TW_DLQ_{run}", target], queues=8)
    # in a process of its own: its callbacks would otherwise take CPU and the GIL from this one's
    recv = RemoteReceiver(mq.namesrv_addr, target)
    producer = RemotingProducer(mq.namesrv_addr, f"cap_producer_{run}")
    data = work / "serve"
    # checkpoint often so the ingest log (bounded, not per message) is let go before disk is measured
    admin = free_port()
    proc = start_serve(data, serve_env(mq, run, **{"TIMEWHEEL_ENGINE_CHECKPOINT_SECONDS": "2", **(serve_extra or {})}),
                       work / "serve.log", admin, tree=engine_tree)
    meter = CpuMeter(proc.pid)
    try:
        said: list[str] = []
        if ha and not _wait(lambda: holds_lease(f"127.0.0.1:{admin}", said), 120):
            last = f"; the last /status error: {said[-1]}" if said else ""
            raise RuntimeError(f"the engine never took the lease (see {work / 'serve.log'}){last}")
        # idle: timers, long polls, heartbeats
        c0, k0, t0 = meter.sample()[1], _system_seconds(proc.pid), time.monotonic()
        time.sleep(5.0)
        idle = (meter.sample()[1] - c0) / (time.monotonic() - t0)
        idle_kernel = (_system_seconds(proc.pid) - k0) / (time.monotonic() - t0)
        out["idle"] = {"cpu_cores": round(idle, 4), "rss_mb": round(_rss_bytes(proc.pid) / 2**20, 1)}
        # ingest: due in two hours, so nothing is loaded into the wheel
        far = time.time_ns() // 1_000_000 + 7_200_000
        ingest_msgs = [OutgoingMessage(delay_topic, BODY + str(i).encode(), None, None, {
            "TW_TARGET_TOPIC": target, "TW_DELIVER_AT_MS": str(far + i)}) for i in range(messages)]
        with Profile(proc.pid, profile and profile / "ingest.txt", gil=gil):
            c0, k0, t0 = meter.sample()[1], _system_seconds(proc.pid), time.monotonic()
            sent = produce(producer, ingest_msgs)
            _wait(lambda: _stored(data) >= sent, 600)
            dt, cpu = time.monotonic() - t0, meter.sample()[1] - c0
            kernel = _system_seconds(proc.pid) - k0
        time.sleep(5.0)  # two checkpoints: the ingest log is let go
        disk = data_dir_bytes(data)
        out["ingest"] = {"messages": sent, "seconds": round(dt, 1), "per_s": round(sent / dt),
                         "cpu_us_per_message": round((cpu - idle * dt) / sent * 1e6, 1),
                         "kernel_us_per_message": round((kernel - idle_kernel * dt) / sent * 1e6, 1),
                         "disk_bytes_per_message": round(disk / sent, 1), "body_bytes": len(BODY)}
        print("ingest", out["ingest"], flush=True)
        ingest_s_per_msg = dt / max(sent, 1)  # sending and storing the due ones takes about as long
        for label, rate in [("delivery", due_rate), *((f"delivery_{r}", r) for r in other_rates)]:
            with Profile(proc.pid, profile and profile / f"{label}.txt", gil=gil):
                out[label] = _delivery(producer, recv, meter, data, delay_topic, target, rate, ingest_s_per_msg,
                                       (idle, idle_kernel), proc.pid, work / "serve.log")
            print(label, out[label], flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        producer.close()
        recv.stop()


def _delivery(producer: RemotingProducer, recv: RemoteReceiver, meter: CpuMeter, data: Path, delay_topic: str,
              target: str, due_rate: int, ingest_s_per_msg: float, idle: tuple[float, float], pid: int,
              log_path: Path) -> dict[str, object]:
    """`due_rate` messages a second coming due for DUE_SECONDS, starting once all are sent and stored;
    the serve process's CPU and its kernel share (idle's (cores, kernel cores) subtracted) per
    delivered message, and their lateness."""
    n = int(due_rate * DUE_SECONDS)
    start_ms = time.time_ns() // 1_000_000 + 10_000 + int(3 * ingest_s_per_msg * 1000 * n)
    before = _stored(data)
    recv.reset()  # an earlier phase's messages are all in
    # distinct bodies: the client can give two messages one UNIQ_KEY, and equal content with an
    # equal due time would then be stored once
    n = produce(producer, [OutgoingMessage(delay_topic, BODY + str(i).encode(), None, None, {
        "TW_TARGET_TOPIC": target, "TW_DELIVER_AT_MS": str(start_ms + i * 1000 // due_rate)})
        for i in range(n)])  # what the broker acknowledged
    _wait(lambda: _stored(data) >= before + n, 600)
    n = _stored(data) - before
    time.sleep(max(0.0, start_ms / 1000 - time.time() - 1.5))
    early = recv.count()  # delivered before measuring: none unless the engine ran early
    c0, k0, t0 = meter.sample()[1], _system_seconds(pid), time.monotonic()
    _wait(lambda: recv.count() >= n, DUE_SECONDS + 120)
    dt, cpu = time.monotonic() - t0, meter.sample()[1] - c0
    kernel = _system_seconds(pid) - k0
    received = recv.count()
    if received < n:  # the CPU per message would be diluted by the wait: no figure
        raise SystemExit(f"only {received} of {n} due messages were delivered at {due_rate}/s; see {log_path}")
    late = lateness_summary(recv.late()[0])
    return {"due_per_s": due_rate, "messages": n, "delivered": received, "delivered_before_measuring": early,
            "seconds": round(dt, 1), "cpu_us_per_message": round((cpu - idle[0] * dt) / n * 1e6, 1),
            "kernel_us_per_message": round((kernel - idle[1] * dt) / n * 1e6, 1),
            "lateness_ms": late}


def per_send(due_per_s: float, rmq: RocketMQConfig, batch_size: int = EngineConfig.send_batch_size) -> float:
    """Messages a send carries at `due_per_s`: those due over the send linger the engine picks at
    that rate (`timewheel.dispatch_queue`) and the millisecond the timer turns in, at least one and
    at most a full batch (`engine.send_batch_size`)."""
    linger = linger_for_rate(due_per_s, rmq.send_linger_ms, rmq.send_linger_max_ms)
    return min(float(batch_size), max(1.0, due_per_s * (linger + 1) / 1000))


def fit_delivery(points: Sequence[tuple[float, float]], rmq: RocketMQConfig,
                 batch_size: int = EngineConfig.send_batch_size) -> dict[str, float]:
    """A CPU cost per send and per message fitted to two measured (due a second, µs a message)
    points; linear (no cost per send) when they cannot be told apart."""
    (r1, c1), (r2, c2) = points
    inv1, inv2 = 1 / per_send(r1, rmq, batch_size), 1 / per_send(r2, rmq, batch_size)
    send_us = (c1 - c2) / (inv1 - inv2) if inv1 != inv2 else 0.0
    if send_us <= 0:
        send_us = 0.0
    return {"us_per_send": round(send_us, 1), "us_per_message": round(max(0.0, c2 - send_us * inv2), 2)}


def delivery_us(due_per_s: float, fit: dict[str, float], rmq: RocketMQConfig,
                batch_size: int = EngineConfig.send_batch_size) -> float:
    """Delivery CPU a message at `due_per_s`, by the fit."""
    return fit["us_per_send"] / per_send(due_per_s, rmq, batch_size) + fit["us_per_message"]


#: a delivery phase whose p99 lateness is over this fell behind: its CPU a message is that of a saturated
#: engine (sends grow to their batch limit), not what the same rate costs an engine that keeps up
BEHIND_P99_MS = 1_000.0


def fit_fell_behind(measured: dict[str, object]) -> list[int]:
    """The due rates of the fit's two delivery phases that fell behind their due times (`BEHIND_P99_MS`)."""
    points = [measured.get("delivery"), measured.get(f"delivery_{measured.get('low_due_rate')}")]
    return sorted({p["due_per_s"] for p in points if isinstance(p, dict)
                   and isinstance(p99 := (p.get("lateness_ms") or {}).get("p99"), (int, float)) and p99 > BEHIND_P99_MS})


def model(measured: dict[str, object], cfg: EngineConfig, rmq: RocketMQConfig) -> dict[str, object]:
    """Per million scheduled, per thousand due a second, and engines for example loads."""
    ing, dlv, mem = measured["ingest"], measured["delivery"], measured["loaded"]
    assert isinstance(ing, dict) and isinstance(dlv, dict) and isinstance(mem, dict)
    rates = sorted((v["due_per_s"], v["cpu_us_per_message"]) for k, v in measured.items()
                   if k.startswith("delivery") and isinstance(v, dict))
    low = measured.get(f"delivery_{measured.get('low_due_rate')}")
    if isinstance(low, dict) and low["due_per_s"] != dlv["due_per_s"]:
        fit = fit_delivery([(low["due_per_s"], low["cpu_us_per_message"]),
                            (dlv["due_per_s"], dlv["cpu_us_per_message"])], rmq, cfg.send_batch_size)
    else:  # one rate measured: linear in the due rate
        fit = {"us_per_send": 0.0, "us_per_message": dlv["cpu_us_per_message"]}
    batch = cfg.send_batch_size
    checks = [{"due_per_s": r, "measured_us": c, "model_us": round(delivery_us(r, fit, rmq, batch), 1)}
              for r, c in rates]
    behind = fit_fell_behind(measured)
    per_entry = mem["rss_bytes_per_entry"]
    # the wheel holds the current segment and, from `preload` before it starts, the next one
    loaded_seconds = cfg.segment_ms / 1000 + cfg.preload_seconds
    per_million = {"disk_gb": round(ing["disk_bytes_per_message"] * 1e6 / 1e9, 3),
                   "ingest_cpu_core_seconds": round(ing["cpu_us_per_message"], 1),
                   "memory_mb_if_loaded": round(per_entry * 1e6 / 2**20, 1), "memory_mb_on_disk_only": 0}
    per_thousand_due = {"cpu_cores": round(delivery_us(1000, fit, rmq, batch) * 1000 / 1e6, 3),
                        "wheel_entries": int(1000 * loaded_seconds),
                        "memory_mb": round(1000 * loaded_seconds * per_entry / 2**20, 1),
                        "dispatch_log_bytes_per_s": 1000 * 24}

    def engines(ingest_per_s: int, due_per_s: int, scheduled: int, disk_gb: float = 1000, memory_gb: float = 8) -> dict:
        cores = (ingest_per_s * ing["cpu_us_per_message"] + due_per_s * delivery_us(due_per_s, fit, rmq, batch)) / 1e6
        disk = scheduled * ing["disk_bytes_per_message"] / 1e9
        memory = due_per_s * loaded_seconds * per_entry / 2**30
        need = {"cpu": math.ceil(cores / CORE_BUDGET), "disk": math.ceil(disk / disk_gb),
                "memory": math.ceil(memory / memory_gb)}
        return {"ingest_per_s": ingest_per_s, "due_per_s": due_per_s, "scheduled": scheduled,
                "cpu_cores": round(cores, 2), "disk_gb": round(disk, 1), "memory_gb": round(memory, 2),
                "engines_by": need, "engines": max(1, *need.values())}

    return {"assumptions": {"core_budget_per_engine": CORE_BUDGET, "disk_gb_per_engine": 1000,
                            "memory_gb_per_engine": 8, "body_bytes": len(BODY), "loaded_seconds": loaded_seconds,
                            "send_linger_ms": rmq.send_linger_ms, "send_linger_max_ms": rmq.send_linger_max_ms},
            "delivery_fit": fit, "delivery_by_rate": checks, "fit_fell_behind_at_due_per_s": behind,
            "per_million_scheduled": per_million, "per_thousand_due_per_s": per_thousand_due,
            "examples": [engines(1_000, 1_000, 100_000_000), engines(10_000, 10_000, 1_000_000_000),
                         engines(5_000, 50_000, 200_000_000)]}


def main(argv: Sequence[str] | None = None) -> None:
    """Measure, model, print and write bench/results/capacity.json."""
    ap = argparse.ArgumentParser(prog="python -m bench.capacity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=50_000, help="delay messages ingested through RocketMQ")
    ap.add_argument("--due-rate", type=int, default=10_000, help="messages due per second for 10 s")
    ap.add_argument("--low-due-rate", type=int, default=1_000, help="then this many for 10 s: the second point of "
                    "the delivery fit (0: none, delivery CPU taken as linear in the due rate)")
    ap.add_argument("--check-rate", type=int, action="append", default=None,
                    help="then this many for 10 s, measured beside the fit's prediction (repeatable; "
                    "default 2000 and 5000; 0: none)")
    ap.add_argument("--loaded", type=int, default=500_000, help="messages in the wheel for the memory figure")
    ap.add_argument("--profile", type=Path, help="directory for py-spy profiles (collapsed stacks) of the serve "
                    "process while it ingests and while it delivers")
    ap.add_argument("--gil", action="store_true", help="with --profile: keep only the samples of the thread "
                    "holding the GIL (where the engine's Python runs, not where it waits)")
    ap.add_argument("--serve-env", action="append", default=[], metavar="TIMEWHEEL_X=VALUE",
                    help="a setting of the measured engine, as its environment variable (repeatable)")
    ap.add_argument("--ha", action="store_true", help="run the measured engine as a replica set of one ([ha] on "
                    "a local ZooKeeper): what a replica's fencing, watermark and look-ups cost")
    ap.add_argument("--skip-loaded", action="store_true", help="measure through RocketMQ only (no loaded memory)")
    ap.add_argument("--engine-tree", type=Path, help="measure the `timewheel serve` of this checkout of another "
                    "revision (`bench.peers ab --engine-only` makes one): writes only the figures through RocketMQ "
                    "(the loaded memory and the model would be this checkout's code)")
    ap.add_argument("--table", action="store_true", help="print the tables of the results in --out, measure nothing")
    ap.add_argument("--out", type=Path, default=RESULTS / "capacity.json",
                    help="the results file (default bench/results/capacity.json)")
    args = ap.parse_args(argv)
    if bad := [kv for kv in args.serve_env if not kv.startswith("TIMEWHEEL_") or "=" not in kv]:
        ap.error(f"--serve-env takes TIMEWHEEL_NAME=VALUE, not {bad[0]!r}")
    if args.table:
        print(markdown(json.loads(args.out.read_text())))
        return
    if args.engine_tree is not None and (why := not_a_checkout(args.engine_tree)):
        ap.error(f"--engine-tree: {why}")
    if args.engine_tree is not None and args.ha:
        ap.error("--ha measures this checkout's replica set: drop --engine-tree or --ha")
    work = Path(tempfile.mkdtemp(prefix="tw-capacity-"))
    out: dict[str, object] = {"machine": _machine(), "command": " ".join(["python -m bench.capacity", *(sys.argv[1:] if argv is None else argv)])}
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    serve_extra = dict(kv.split("=", 1) for kv in args.serve_env)
    checks = [r for r in (args.check_rate if args.check_rate is not None else [2_000, 5_000]) if r > 0]
    others = [r for r in [args.low_due_rate, *checks] if r > 0 and r != args.due_rate]
    measured = through_rocketmq(args.messages, args.due_rate, work, args.profile, args.gil, serve_extra, others,
                                args.ha, args.engine_tree)
    measured["ha"] = args.ha
    measured["low_due_rate"] = args.low_due_rate
    if args.skip_loaded or args.engine_tree is not None:
        print(json.dumps(measured, indent=2))
        if args.engine_tree is not None:
            out["measured"] = measured
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(out, indent=2) + "\n")
        return
    measured["loaded"] = loaded_memory(args.loaded, work)
    print("loaded", measured["loaded"], flush=True)
    out["measured"] = measured
    out["model"] = model(measured, EngineConfig(work), _linger(serve_extra))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(markdown(out))


def _linger(serve_extra: dict[str, str]) -> RocketMQConfig:
    """The sink settings the measured engine ran with: its defaults, then the `--serve-env` ones."""
    return load_settings(None, {"TIMEWHEEL_ENGINE_DATA_DIR": tempfile.gettempdir(), **serve_extra}).rocketmq


def markdown(out: dict) -> str:
    """The tables docs/OPERATIONS.md quotes."""
    m, mod = out["measured"], out["model"]
    pm, pt = mod["per_million_scheduled"], mod["per_thousand_due_per_s"]
    rows = [f"Measured: ingest {m['ingest']['per_s']}/s through RocketMQ, {m['ingest']['cpu_us_per_message']} µs CPU "
            f"and {m['ingest']['disk_bytes_per_message']} bytes of disk per message ({m['ingest']['body_bytes']}-byte "
            f"bodies); delivery at {m['delivery']['due_per_s']}/s, {m['delivery']['cpu_us_per_message']} µs CPU per "
            f"message, lateness p99 {m['delivery']['lateness_ms'].get('p99')} ms; "
            f"{m['loaded']['rss_bytes_per_entry']} bytes of RSS per message in the wheel "
            f"({m['loaded']['wheel_bytes_per_entry']} of them the wheel's arrays); idle "
            f"{m['idle']['cpu_cores']} cores, {m['idle']['rss_mb']} MB RSS. Load average when started: "
            f"{out['machine'].get('load_average_1_5_15')}."
            + (" The engine ran as a replica set of one (`--ha`)." if m.get("ha") else ""),
            "",
            *_fit_rows(mod, fit_fell_behind(m)),
            "",
            "| resource | per million scheduled | per thousand due a second |",
            "| --- | --- | --- |",
            f"| disk | {pm['disk_gb']} GB | {pt['dispatch_log_bytes_per_s'] / 1000:g} kB/s of dispatch log |",
            f"| memory | {pm['memory_mb_if_loaded']} MB if due within the loaded segments, else 0 | "
            f"{pt['memory_mb']} MB ({pt['wheel_entries']} entries: a segment and the preload) |",
            f"| CPU | {pm['ingest_cpu_core_seconds']} core-seconds to ingest | {pt['cpu_cores']} cores |",
            "",
            "| ingest/s | due/s | scheduled | CPU cores | disk GB | memory GB | engines (cpu, disk, memory) |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for e in mod["examples"]:
        by = e["engines_by"]
        rows.append(f"| {e['ingest_per_s']} | {e['due_per_s']} | {e['scheduled']:,} | {e['cpu_cores']} | {e['disk_gb']} "
                    f"| {e['memory_gb']} | **{e['engines']}** ({by['cpu']}, {by['disk']}, {by['memory']}) |")
    return "\n".join(rows)



def _fit_rows(mod: dict, behind: list[int]) -> list[str]:
    """Delivery CPU by due rate: measured, and what the fit says."""
    fit = mod.get("delivery_fit")
    if not fit:
        return []
    rows = [f"Delivery CPU fitted as {fit['us_per_send']} µs a send + {fit['us_per_message']} µs a message, a "
            f"send carrying what comes due over the send linger ({mod['assumptions'].get('send_linger_ms')} ms "
            f"growing to {mod['assumptions'].get('send_linger_max_ms')} ms at {FULL_LINGER_RATE:,} due a second) "
            "and the timer's millisecond:", "",
            "| due a second | measured µs a message | the fit's µs a message | cores |",
            "| ---: | ---: | ---: | ---: |"]
    for c in mod.get("delivery_by_rate", []):
        rows.append(f"| {c['due_per_s']:,} | {c['measured_us']} | {c['model_us']} | "
                    f"{c['measured_us'] * c['due_per_s'] / 1e6:.3f} |")
    if behind:
        rows += ["", f"**Do not size from this fit.** The engine fell behind at {', '.join(f'{r:,}' for r in behind)} "
                 f"due a second (p99 lateness over {BEHIND_P99_MS / 1000:g} s), so the fit is through a saturated "
                 "engine's cost: measure on a machine where that phase keeps up, or with a lower `--due-rate`."]
    return rows


if __name__ == "__main__":
    main()
