"""End-to-end harness through a real local RocketMQ: ingest rate, dispatch rate, lateness.

    python -m bench.rocketmq_e2e [--ingest 50000] [--dispatch 50000] [--rate 1000 --rate 5000] [--seconds 20]

- ingest: N delay messages are sent before the engine starts; the rate is N over the time the
  engine takes to store them all (acknowledged = stored);
- dispatch: N stored messages all due at the same millisecond; the rate is N over the time from
  that millisecond to the last send the broker acknowledged;
- lateness: a producer sends R messages/s, each due 2 s later; a consumer on the target topic
  records receive time minus due time (TW_DUE_MS on the delivered message).
Writes bench/results/rocketmq_e2e.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

import numpy as np

from forwarder import LocalRocketMQ
from forwarder._rmq_native import LogLevel, NativeProducer, NativePushConsumer, OutgoingMessage, ReceivedMessage
from timewheel.config import EngineConfig, RocketMQConfig
from timewheel.service import Service
from timewheel.settings import AdminConfig, Settings

RESULTS = Path(__file__).parent / "results"
BODY = b"x" * 200


class Receiver:
    """Counts target-topic messages and their lateness."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.late: list[float] = []
        self.seen: set[str] = set()
        self.last_ns = 0

    def __call__(self, msg: ReceivedMessage) -> bool:
        now = time.time_ns()
        with self.lock:
            oid = msg.properties.get("TW_ORIGINAL_MSG_ID", "")
            if oid in self.seen:
                return True
            self.seen.add(oid)
            self.late.append(now / 1e6 - int(msg.properties.get("TW_DUE_MS", now // 1_000_000)))
            self.last_ns = now
        return True

    def reset(self) -> None:
        with self.lock:
            self.late.clear()
            self.seen.clear()


def _send_many(producer: NativeProducer, msgs: Sequence[OutgoingMessage], threads: int = 8) -> int:
    def one(m: OutgoingMessage) -> int:
        for _ in range(5):
            try:
                producer.send(m)
                return 1
            except Exception:
                time.sleep(0.05)
        return 0

    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(one, msgs))


def _wait(pred, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


def _pct(a: Sequence[float]) -> dict[str, float]:
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
    ap.add_argument("--ingest", type=int, default=50_000)
    ap.add_argument("--dispatch", type=int, default=50_000)
    ap.add_argument("--rate", type=int, action="append")
    ap.add_argument("--seconds", type=float, default=20.0)
    args = ap.parse_args(argv)
    rates = args.rate or [1000, 5000]
    out: dict[str, object] = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                          "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                          "load_avg_before": os.getloadavg()[0]},
                              "command": "python -m bench.rocketmq_e2e " + " ".join(argv or [])}
    work = Path(tempfile.mkdtemp(prefix="tw-bench-"))
    mq = LocalRocketMQ(work / "mq", stop_timeout=3.0)
    mq.start()
    try:
        cfg = RocketMQConfig(namesrv=mq.namesrv_addr, consume_threads=4, send_threads=8)
        mq.create_topics([cfg.delay_topic, cfg.dead_letter_topic, "BENCH_OUT"], queues=8)
        producer = NativeProducer("bench-producer", mq.namesrv_addr, log_level=LogLevel.ERROR)
        producer.start()
        recv = Receiver()
        consumer = NativePushConsumer("bench-consumer", mq.namesrv_addr, recv, thread_count=4,
                                      log_level=LogLevel.ERROR)
        consumer.subscribe("BENCH_OUT")
        consumer.start()
        # 1. ingest: messages wait in the delay topic, then the engine starts and stores them
        far = time.time_ns() // 1_000_000 + 3_600_000
        n = _send_many(producer, [OutgoingMessage(cfg.delay_topic, BODY, None, None,
                                                  {"TW_TARGET_TOPIC": "BENCH_OUT", "TW_DELIVER_AT_MS": str(far)})
                                  for _ in range(args.ingest)])
        service = Service(Settings(engine=EngineConfig(work / "data"), rocketmq=cfg,
                                   admin=AdminConfig(listen="127.0.0.1:0")))
        t0 = time.perf_counter()
        service.start()
        assert service.engine is not None
        _wait(lambda: service.engine.stats()["scheduled"] >= n, 600)  # type: ignore[union-attr,operator]
        ingest_s = time.perf_counter() - t0
        out["ingest"] = {"messages": n, "seconds": round(ingest_s, 2), "per_s": round(n / ingest_s),
                         "note": "includes the consumer's start-up (route lookup, rebalance)"}
        print("ingest", out["ingest"], flush=True)
        # 2. dispatch: everything due at one millisecond
        due = time.time_ns() // 1_000_000 + 3000 + args.dispatch // 20
        before = service.engine.stats()["scheduled"]
        delivered0 = service.engine.stats()["delivered"]  # before scheduling: they may be sent at once
        for start in range(0, args.dispatch, 5000):
            from timewheel import Message
            service.engine.schedule([Message("BENCH_OUT", BODY, due) for _ in range(min(5000, args.dispatch - start))])
        recv.reset()
        _wait(lambda: service.engine.stats()["delivered"] - delivered0 >= args.dispatch, 600)  # type: ignore
        done_ns = time.time_ns()
        d_s = max(1e-3, done_ns / 1e9 - due / 1000)
        out["dispatch"] = {"messages": args.dispatch, "seconds": round(d_s, 2), "per_s": round(args.dispatch / d_s),
                           "scheduled_before": before}
        print("dispatch", out["dispatch"], flush=True)
        _wait(lambda: len(recv.seen) >= args.dispatch, 120)
        # 3. lateness at steady rates
        lat = {}
        for rate in rates:
            recv.reset()
            total = int(rate * args.seconds)
            stop_at = time.monotonic() + args.seconds

            def produce(share: int, k: int) -> None:
                t_start = time.monotonic()
                for i in range(share):
                    now = time.time_ns() // 1_000_000
                    try:
                        producer.send(OutgoingMessage(cfg.delay_topic, BODY, None, None,
                                                      {"TW_TARGET_TOPIC": "BENCH_OUT", "TW_DELIVER_AT_MS": str(now + 2000)}))
                    except Exception:
                        pass
                    time.sleep(max(0.0, t_start + (i + 1) * k / rate - time.monotonic()))

            k = max(1, min(8, rate // 500))
            threads = [threading.Thread(target=produce, args=(total // k, k)) for _ in range(k)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            _wait(lambda: len(recv.seen) >= total * 0.999, 60)
            time.sleep(1)
            with recv.lock:
                lat[str(rate)] = {"sent": total, "received": len(recv.late), **_pct(recv.late),
                                  "producer_seconds": round(args.seconds + max(0, time.monotonic() - stop_at), 1)}
            print("lateness", rate, lat[str(rate)], flush=True)
        out["lateness_ms"] = lat
        out["engine"] = {k: v for k, v in service.engine.stats().items() if isinstance(v, (int, float))}
        service.stop()
        consumer.shutdown()
        producer.shutdown()
    finally:
        mq.stop()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "rocketmq_e2e.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
