"""End-to-end harness through a real local RocketMQ: ingest rate, dispatch rate, lateness.

    python -m bench.rocketmq_e2e [--ingest 50000] [--burst 50000] [--rate 1000 --rate 5000] [--seconds 20]
                                 [--intake-ceiling]

- ingest: N delay messages are sent before the engine starts; the rate is N over the time the
  engine takes to store them all (acknowledged = stored), with this process's CPU per message
  (the harness only waits meanwhile: the CPU is the engine's);
- dispatch (the burst): N stored messages all due at the same millisecond; the rate is N over the
  time from that millisecond to the last send the broker acknowledged; lateness of each message
  as the broker's acknowledgement saw it (the engine's send lateness); CPU per message as for
  ingest. The consumer in another process is paused meanwhile (as nothing else runs beside the
  intake ceiling), then counts what arrived and any duplicate;
- intake ceiling (--intake-ceiling): RocketMQ's own Java producer sending batches from 4 threads
  to an 8-queue topic for 10 s: what the broker takes in, the reference for both rates above;
- lateness: a producer sends R messages/s, each due 2 s later; a consumer on the target topic
  records receive time minus due time (TW_DUE_MS on the delivered message).
Writes bench/results/rocketmq_e2e.json.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import platform
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from datetime import datetime, timezone
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from forwarder import LocalRocketMQ
from forwarder._rmq_native import LogLevel, NativePushConsumer
from forwarder.rocketmq import OutgoingMessage, ReceivedMessage
from forwarder.rocketmq import Receipt, RemotingProducer
from forwarder.config import RocketMQConfig
from timewheel.config import EngineConfig
from timewheel.app.service import Service
from timewheel.app.settings import AdminConfig, Settings

RESULTS = Path(__file__).parent / "results"
BODY = b"x" * 200


class Receiver:
    """Counts target-topic messages and their lateness."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.late: list[float] = []
        self.seen: set[str] = set()
        self.last_ns = 0
        self.duplicates = 0

    def __call__(self, msg: ReceivedMessage) -> bool:
        now = time.time_ns()
        with self.lock:
            oid = msg.properties.get("TW_ORIGINAL_MSG_ID", "")
            if oid in self.seen:
                self.duplicates += 1
                return True
            self.seen.add(oid)
            self.late.append(now / 1e6 - int(msg.properties.get("TW_DUE_MS", now // 1_000_000)))
            self.last_ns = now
        return True

    def reset(self) -> None:
        with self.lock:
            self.late.clear()
            self.seen.clear()
            self.duplicates = 0


def _receiver_process(namesrv: str, topic: str, conn: Connection) -> None:
    """Child process: consume `topic` and answer the parent's requests (count, reset, lateness).

    The consumer runs apart from the engine, as an application's would: in the engine's process
    its callbacks (~50 µs of Python each) would compete with the dispatch thread for the GIL.
    """
    recv = Receiver()
    consumer = NativePushConsumer("bench-consumer", namesrv, recv, thread_count=4, log_level=LogLevel.ERROR)
    consumer.subscribe(topic)
    consumer.start()
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd == "count":
            conn.send(len(recv.seen))
        elif cmd == "reset":
            recv.reset()
            conn.send(None)
        elif cmd == "late":
            with recv.lock:
                conn.send((list(recv.late), recv.duplicates))
        else:
            consumer.shutdown(destroy=False)
            conn.send(None)
            return


class RemoteReceiver:
    """The parent's handle on the receiver process."""

    def __init__(self, namesrv: str, topic: str) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_receiver_process, args=(namesrv, topic, child), daemon=True)
        self._proc.start()
        if not self._conn.poll(120) or self._conn.recv() != "ready":
            raise RuntimeError("the receiver process did not start")

    def _ask(self, cmd: str) -> object:
        self._conn.send(cmd)
        return self._conn.recv()

    def count(self) -> int:
        """Distinct messages received since the last reset."""
        return int(self._ask("count"))  # type: ignore[call-overload]

    def reset(self) -> None:
        """Forget what was received."""
        self._ask("reset")

    def late(self) -> tuple[list[float], int]:
        """Lateness (ms) of each distinct message received since the last reset, and duplicates."""
        return self._ask("late")  # type: ignore[return-value]

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The receiver process stopped (SIGSTOP) meanwhile, so that it takes no CPU from the broker
        and the engine; it reads on (SIGCONT) afterwards, whatever happened meanwhile."""
        os.kill(self._proc.pid, signal.SIGSTOP)  # type: ignore[arg-type]
        try:
            yield
        finally:
            os.kill(self._proc.pid, signal.SIGCONT)  # type: ignore[arg-type]

    def stop(self) -> None:
        """Shut the consumer down and end the process."""
        self._ask("stop")
        self._proc.join(30)


def _delay_messages(cfg: RocketMQConfig, target: str, dues: Sequence[int], tag: str) -> list[OutgoingMessage]:
    """Delay messages with distinct bodies (identical ones would share a dedup id and be stored once)."""
    return [OutgoingMessage(cfg.delay_topic, BODY + f"{tag}{i}".encode(), None, None,
                            {"TW_TARGET_TOPIC": target, "TW_DELIVER_AT_MS": str(d)}) for i, d in enumerate(dues)]


def produce(producer: RemotingProducer, msgs: Sequence[OutgoingMessage], chunk: int = 1000) -> int:
    """Send in SEND_BATCH requests; returns how many the broker stored (failures are retried 5 times)."""
    stored = 0
    for start in range(0, len(msgs), chunk):
        todo = list(msgs[start:start + chunk])
        for _ in range(5):
            res = producer.send(todo)
            stored += sum(1 for r in res if isinstance(r, Receipt))
            todo = [m for m, r in zip(todo, res) if not isinstance(r, Receipt)]
            if not todo:
                break
            time.sleep(0.1)
    return stored


def _cpu_s() -> float:
    """User + system CPU seconds of this process (every thread)."""
    t = os.times()
    return t.user + t.system


def _wait(pred: Callable[[], bool], timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


def lateness_summary(a: Sequence[float]) -> dict[str, float]:
    """p50, p99, p999, max and count of lateness figures (ms)."""
    x = np.asarray(a)
    if not len(x):
        return {}
    p = np.percentile(x, [50, 99, 99.9])
    return {"p50": round(float(p[0]), 2), "p99": round(float(p[1]), 2), "p999": round(float(p[2]), 2),
            "max": round(float(x.max()), 2), "count": int(len(x))}


def main(argv: Sequence[str] | None = None) -> None:
    """Run the three measurements and print/write the figures."""
    ap = argparse.ArgumentParser(prog="python -m bench.rocketmq_e2e", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ingest", type=int, default=50_000, help="delay messages for the ingest rate")
    ap.add_argument("--burst", "--dispatch", dest="dispatch", type=int, default=50_000,
                    help="messages due at one millisecond (the dispatch rate and burst lateness)")
    ap.add_argument("--intake-ceiling", action="store_true",
                    help="first measure the broker's intake with RocketMQ's own Java producer")
    ap.add_argument("--rate", type=int, action="append", help="steady due rate for lateness (repeatable)")
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each lateness run")
    ap.add_argument("--send-threads", type=int, default=RocketMQConfig.send_threads,
                    help="delivery producers, one dispatch thread each (rocketmq.send_threads)")
    ap.add_argument("--profile", type=Path, help="directory for py-spy profiles of this process during the burst "
                    "(all threads, and GIL holders only: the share of the time the GIL was held)")
    ap.add_argument("--skip-steady", action="store_true", help="stop after the burst (no lateness at steady rates)")
    ap.add_argument("--out", type=Path, default=RESULTS / "rocketmq_e2e.json", help="where to write the figures")
    args = ap.parse_args(argv)
    rates = args.rate or [1000, 5000]
    out: dict[str, object] = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                          "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                          "load_average_before": [round(x, 2) for x in os.getloadavg()]},
                              "command": "python -m bench.rocketmq_e2e " + " ".join(argv or sys.argv[1:])}
    work = Path(tempfile.mkdtemp(prefix="tw-bench-"))
    mq = LocalRocketMQ(work / "mq", stop_timeout=3.0)
    mq.start()
    try:
        cfg = RocketMQConfig(namesrv=mq.namesrv_addr, send_threads=args.send_threads)
        mq.create_topics([cfg.delay_topic, cfg.dead_letter_topic, "BENCH_OUT"], queues=8)
        if args.intake_ceiling:
            from forwarder.java_client import JavaClient
            mq.create_topics(["BENCH_INTAKE"], queues=8)
            out["intake_ceiling"] = JavaClient(mq.namesrv_addr).intake("BENCH_INTAKE", seconds=10, threads=4,
                                                                       batch=128, body_size=len(BODY))
            print("intake ceiling", out["intake_ceiling"], flush=True)
        producer = RemotingProducer(mq.namesrv_addr, "bench-producer")
        recv = RemoteReceiver(mq.namesrv_addr, "BENCH_OUT")
        # 1. ingest: messages wait in the delay topic, then the engine starts and stores them
        far = time.time_ns() // 1_000_000 + 3_600_000
        n = produce(producer, _delay_messages(cfg, "BENCH_OUT", [far] * args.ingest, "i"))
        service = Service(Settings(engine=EngineConfig(work / "data"), rocketmq=cfg,
                                   admin=AdminConfig(listen="127.0.0.1:0")))
        t0, c0 = time.perf_counter(), _cpu_s()
        service.start()
        engine = service.engine
        assert engine is not None
        stored = lambda: engine.stats().counters.scheduled  # noqa: E731
        first = None
        while stored() < n and time.perf_counter() - t0 < 600:
            if first is None and stored():
                first = (time.perf_counter(), stored())
            time.sleep(0.02)
        t1, c1 = time.perf_counter(), _cpu_s()
        got = stored()
        first = first or (t0, 0)
        out["ingest"] = {"messages": n, "stored": got, "seconds": round(t1 - t0, 2), "per_s": round(got / (t1 - t0)),
                         "per_s_after_first_stored": round((got - first[1]) / max(1e-3, t1 - first[0])),
                         "cpu_us_per_message": round((c1 - c0) / max(1, got) * 1e6, 1),
                         "ingest_client": "pull",
                         "note": "per_s includes the consumer's start-up (route lookup, rebalance)"}
        print("ingest", out["ingest"], flush=True)
        # 2. dispatch: everything due at one millisecond, through the broker to BENCH_OUT
        delivered0 = engine.stats().counters.delivered
        due = time.time_ns() // 1_000_000 + 3000 + args.dispatch // 10  # scheduled in time on a busy machine
        from timewheel import Message
        for start in range(0, args.dispatch, 5000):
            engine.schedule([Message("BENCH_OUT", BODY + f"d{start + i}".encode(), due)
                             for i in range(min(5000, args.dispatch - start))])
        if time.time_ns() // 1_000_000 >= due:
            raise SystemExit("scheduling took longer than the lead time; lower --dispatch")
        recv.reset()
        engine.lateness.reset()
        # The intake ceiling is measured with nothing else on the machine; the receiver (a saturated
        # Python consumer) would take a core from the broker and the engine while they dispatch.
        with recv.paused():
            time.sleep(max(0.0, due / 1000 - time.time() - 1.5))
            from bench.capacity import Profile
            if args.profile:
                args.profile.mkdir(parents=True, exist_ok=True)
            with Profile(os.getpid(), args.profile and args.profile / "burst_gil.txt", gil=True) as prof:
                time.sleep(max(0.0, due / 1000 - time.time() - 0.2))
                c0 = _cpu_s()
                _wait(lambda: engine.stats().counters.delivered - delivered0 >= args.dispatch, 600)
                done_ns, c1 = time.time_ns(), _cpu_s()
            d_s = max(1e-3, done_ns / 1e9 - due / 1000)
            dispatched = engine.stats().counters.delivered - delivered0
            out["dispatch"] = {"messages": args.dispatch, "seconds": round(d_s, 2), "per_s": round(args.dispatch / d_s),
                               "cpu_us_per_message": round((c1 - c0) / max(1, dispatched) * 1e6, 1),
                               "engine_send_lateness_ms": asdict(engine.stats().lateness_ms),
                               "gil_held_share": prof.gil_share()}
            print("dispatch", out["dispatch"], flush=True)
        _wait(lambda: recv.count() >= args.dispatch, 180)
        late, dups = recv.late()
        out["dispatch"].update({"received_by_consumer": recv.count(), "duplicates": dups,  # type: ignore[attr-defined]
                                "consumer": "paused while the engine dispatched, then read everything"})
        print("burst at the consumer", recv.count(), "received,", dups, "duplicates", flush=True)
        if "intake_ceiling" in out:
            ceiling = out["intake_ceiling"]["rate"]  # type: ignore[index]
            out["of_intake_ceiling"] = {"ingest": round(out["ingest"]["per_s"] / ceiling, 2),  # type: ignore[index]
                                        "dispatch": round(out["dispatch"]["per_s"] / ceiling, 2)}  # type: ignore[index]
        # 3. lateness at steady rates: each message due 2 s after it is produced
        lat = {}
        for rate in ([] if args.skip_steady else rates):
            recv.reset()
            engine.lateness.reset()
            total = int(rate * args.seconds)
            tick = 0.01
            per_tick = rate * tick
            t_start = time.monotonic()
            sent = 0
            while sent < total:
                want = min(total, int((time.monotonic() - t_start) / tick * per_tick) + int(per_tick))
                if want > sent:
                    now = time.time_ns() // 1_000_000
                    sent += produce(producer, _delay_messages(cfg, "BENCH_OUT", [now + 2000] * (want - sent),
                                                               f"r{rate}-{sent}-"))
                time.sleep(max(0.0, t_start + (sent / per_tick) * tick - time.monotonic()))
            producer_s = time.monotonic() - t_start
            _wait(lambda: recv.count() >= sent, 60)
            time.sleep(1)
            late, dups = recv.late()
            lat[str(rate)] = {"sent": sent, "received": len(late), "duplicates": dups, **lateness_summary(late),
                              "producer_seconds": round(producer_s, 1),
                              "engine_send_lateness_ms": asdict(engine.stats().lateness_ms)}
            print("lateness", rate, lat[str(rate)], flush=True)
        out["lateness_ms"] = lat
        out["engine"] = {k: v for k, v in engine.stats().as_dict().items() if isinstance(v, (int, float))}
        out["machine"]["load_average_after"] = [round(x, 2) for x in os.getloadavg()]  # type: ignore[index]
        service.stop()
        recv.stop()
        producer.close()
    finally:
        mq.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
