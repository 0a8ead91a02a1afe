"""`timewheel serve` as a process: SIGTERM during load exits 0 and loses nothing acknowledged."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from forwarder._rmq_native import NativeProducer, NativePushConsumer
from forwarder.rocketmq import OutgoingMessage, ReceivedMessage
from forwarder.local_rocketmq import LocalRocketMQ
from tests.polling import admin_ready, wait_for
from tests.ports import free_port

pytestmark = [pytest.mark.rocketmq, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def _serve(data_dir: Path, env: dict[str, str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {**env, "TIMEWHEEL_ADMIN_LISTEN": f"127.0.0.1:{port}"}
    with open(log, "ab") as err:  # the child writes to its own copy of the descriptor
        proc = subprocess.Popen([sys.executable, "-m", "timewheel", "serve", "--data-dir", str(data_dir),
                                 "--log-format", "json"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
    if wait_for(lambda: admin_ready(port), 60, 0.2):
        return proc, f"http://127.0.0.1:{port}"
    proc.kill()
    raise AssertionError(f"serve never became ready: {log.read_text()[-2000:]}")


def test_sigterm_under_load_exits_zero_and_loses_nothing(rocketmq: LocalRocketMQ, tmp_path: Path) -> None:
    run = uuid.uuid4().hex[:8]
    delay_topic, target = f"TW_DELAY_{run}", f"SIGTERM_{run}"
    rocketmq.create_topics([delay_topic, f"TW_DLQ_{run}", target])
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIMEWHEEL_")}
    env.update({"TIMEWHEEL_ROCKETMQ_NAMESRV": rocketmq.namesrv_addr, "TIMEWHEEL_ROCKETMQ_DELAY_TOPIC": delay_topic,
                "TIMEWHEEL_ROCKETMQ_DEAD_LETTER_TOPIC": f"TW_DLQ_{run}",
                "TIMEWHEEL_ROCKETMQ_CONSUMER_GROUP": f"tw_ingest_{run}",
                "TIMEWHEEL_ROCKETMQ_PRODUCER_GROUP": f"tw_delivery_{run}", "TIMEWHEEL_ADMIN_TOKEN": "t"})
    got: set[bytes] = set()
    lock = threading.Lock()

    def on_message(m: ReceivedMessage) -> bool:
        with lock:
            got.add(m.body)
        return True

    consumer = NativePushConsumer(f"sigterm_consumer_{run}", rocketmq.namesrv_addr, on_message)
    consumer.subscribe(target)
    consumer.start()
    producer = NativeProducer(f"sigterm_producer_{run}", rocketmq.namesrv_addr)
    producer.start()
    acked: set[bytes] = set()
    data_dir, log = tmp_path / "data", tmp_path / "serve.log"

    def produce(n: int, tag: str) -> None:
        for i in range(n):
            body = f"{tag}-{i}".encode()
            now = time.time_ns() // 1_000_000
            try:
                producer.send(OutgoingMessage(delay_topic, body, None, None,
                                              {"TW_TARGET_TOPIC": target, "TW_DELIVER_AT_MS": str(now + 500 + i % 3000)}))
                acked.add(body)
            except Exception:
                pass
            time.sleep(0.002)

    try:
        # graceful: SIGTERM while ingest and dispatch are both busy
        proc, _ = _serve(data_dir, env, log)
        t = threading.Thread(target=produce, args=(1500, "a"))
        t.start()
        time.sleep(2.0)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-3000:]
        t.join()
        # impatient: a second signal exits at once
        proc, _ = _serve(data_dir, env, log)
        t = threading.Thread(target=produce, args=(1000, "b"))
        t.start()
        time.sleep(1.5)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        t.join()
        # a last run delivers everything that was acknowledged to the producer
        proc, base = _serve(data_dir, env, log)
        metrics = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
        frozen = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("timewheel_gc_frozen_objects ")]
        assert frozen and frozen[0] > 1000, "serve freezes what its start made out of the collector's full passes"
        assert 'timewheel_gc_pauses_total{generation="0"}' in metrics
        assert all(f'timewheel_meta_store_memory_bytes{{kind="{kind}"}}' in metrics
                   for kind in ("block_cache", "memtables", "table_readers")), "the meta store's memory is exported"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            with lock:
                if acked <= got:
                    break
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        producer.shutdown()
        consumer.shutdown()
    with lock:
        missing = acked - got
    assert len(acked) > 2000
    assert not missing, f"{len(missing)} acknowledged messages never delivered, e.g. {sorted(missing)[:5]}"
