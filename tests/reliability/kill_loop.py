"""Kill the engine with SIGKILL at random moments under steady load, restart it, repeat; then check
that every message acknowledged to its producer was delivered at least once.

    python -m tests.reliability.kill_loop --cycles 50      # the long form (starts its own RocketMQ)

The CI form (3 cycles) is tests/reliability/test_engine_kill.py.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from forwarder.local_rocketmq import LocalRocketMQ
from tests.polling import admin_ready, wait_for
from tests.ports import free_port
from tests.reliability.steady_load import SteadyLoad

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class KillLoopResult:
    """What the loop saw: acknowledged = accepted by the broker for the delay topic."""

    cycles: int
    acknowledged: int
    delivered: int
    lost: int
    duplicates: int
    seconds: float


def serve_env(mq: LocalRocketMQ, run: str, **extra: str) -> dict[str, str]:
    """Environment of `timewheel serve` processes of one run: topics and groups of their own on `mq`.

    Every process started with it joins the consumer group `tw_ingest_<run>` on `TW_DELAY_<run>`.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIMEWHEEL_")}
    env.update({"TIMEWHEEL_ROCKETMQ_NAMESRV": mq.namesrv_addr, "TIMEWHEEL_ROCKETMQ_DELAY_TOPIC": f"TW_DELAY_{run}",
                "TIMEWHEEL_ROCKETMQ_DEAD_LETTER_TOPIC": f"TW_DLQ_{run}",
                "TIMEWHEEL_ROCKETMQ_CONSUMER_GROUP": f"tw_ingest_{run}",
                "TIMEWHEEL_ROCKETMQ_PRODUCER_GROUP": f"tw_delivery_{run}", **extra})
    return env


def start_serve(data_dir: Path, env: dict[str, str], log: Path, port: int | None = None,
                tree: Path | None = None) -> subprocess.Popen[bytes]:
    """Start `timewheel serve` on `data_dir` (admin on `port`, else a free loopback port) from the
    checkout `tree` (default this one; `python -m` imports from its working directory first) and wait
    until it is ready."""
    port = port or free_port()
    with open(log, "ab") as err:  # the child writes to its own copy of the descriptor
        proc = subprocess.Popen([sys.executable, "-m", "timewheel", "serve", "--data-dir", str(data_dir),
                                 "--admin", f"127.0.0.1:{port}", "--log-format", "json"], cwd=tree or ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=err)

    def ready() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode}: {log.read_text()[-2000:]}")
        return admin_ready(port)

    if wait_for(ready, 90, 0.2):
        return proc
    proc.kill()
    raise RuntimeError(f"serve never became ready: {log.read_text()[-2000:]}")


def run_kill_loop(mq: LocalRocketMQ, cycles: int, work: Path, *, rate: int = 300, seed: int = 0,
                  drain_timeout: float = 180.0) -> KillLoopResult:
    """Run the loop against a started RocketMQ; returns the tally."""
    rng = random.Random(seed)
    run = uuid.uuid4().hex[:8]
    delay_topic, target = f"TW_DELAY_{run}", f"KILL_{run}"
    mq.create_topics([delay_topic, f"TW_DLQ_{run}", target], queues=4)
    env = serve_env(mq, run, TIMEWHEEL_ENGINE_RETRY_BASE_MS="200", TIMEWHEEL_ENGINE_MAX_ATTEMPTS="1000")
    load = SteadyLoad(mq, run, delay_topic, target, rate=rate, due_in_ms=lambda i: 200 + (i * 7919) % 2800,
                      name="kill")
    data_dir, log = work / "data", work / "serve.log"
    t0 = time.monotonic()
    load.start()
    try:
        for _ in range(cycles):
            proc = start_serve(data_dir, env, log)
            time.sleep(rng.uniform(0.5, 3.0))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        proc = start_serve(data_dir, env, log)
        time.sleep(1.0)
        load.stop_producing()
        load.wait_delivered(drain_timeout)
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    finally:
        load.close()
    t = load.tally()
    return KillLoopResult(cycles, t.acknowledged, t.delivered, t.lost, t.duplicates, round(time.monotonic() - t0, 1))


def main() -> None:
    """The long form: its own local RocketMQ, N cycles, a JSON line with the tally."""
    ap = argparse.ArgumentParser(prog="python -m tests.reliability.kill_loop", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=50)
    ap.add_argument("--rate", type=int, default=300, help="producer messages per second")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tw-kill-loop-"))
    with LocalRocketMQ(work / "mq", stop_timeout=3.0) as mq:
        result = run_kill_loop(mq, args.cycles, work, rate=args.rate, seed=args.seed)
    print(json.dumps(asdict(result)))
    sys.exit(1 if result.lost else 0)


if __name__ == "__main__":
    main()
