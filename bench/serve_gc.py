"""The garbage collector's pauses in `timewheel serve` under a steady load, read from its own metrics.

    python -m bench.serve_gc [--rate 3000] [--seconds 40] [--no-freeze]

A local RocketMQ; `timewheel serve` as a process; delay messages sent to it at `--rate` a second (due
1-5 s later, in batches every 10 ms, through the engine's own wire client) for `--seconds` after
10 s of warm-up. Prints what `timewheel_gc_*` counted over that window (collections and their time
by generation), the longest collection since the start, and how many objects the start froze.
`--no-freeze` runs serve with the freeze turned off, for the comparison.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Sequence

from forwarder import LocalRocketMQ
from forwarder.rocketmq import OutgoingMessage, RemotingProducer
from tests.polling import admin_ready, wait_for

_WARM_S = 10
_GC_FAMILIES = ("timewheel_gc_pauses_total", "timewheel_gc_pause_seconds_total", "timewheel_gc_pause_longest_seconds",
                "timewheel_gc_frozen_objects", "timewheel_delivered_total")


def _samples(text: str, family: str) -> dict[str, float]:
    """Each sample of one metric family in Prometheus text, by its name with labels."""
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(family)}


def _serve(mq: LocalRocketMQ, work: Path, freeze: bool) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TIMEWHEEL_")}
    env.update({"TIMEWHEEL_ROCKETMQ_NAMESRV": mq.namesrv_addr, "TIMEWHEEL_ROCKETMQ_DELAY_TOPIC": "TW_DELAY",
                "TIMEWHEEL_ROCKETMQ_DEAD_LETTER_TOPIC": "TW_DLQ", "TIMEWHEEL_ADMIN_LISTEN": f"127.0.0.1:{port}",
                "TIMEWHEEL_ADMIN_TOKEN": "bench", "PYTHONPATH": os.getcwd()})
    off = "" if freeze else "import timewheel.app.service as s; s.freeze_started_heap = lambda: 0; "
    with open(work / "serve.log", "wb") as log:  # the child writes to its own copy of the descriptor
        proc = subprocess.Popen([sys.executable, "-c", off + "import sys; from timewheel.app.cli import main; "
                                 "sys.argv[0] = 'timewheel'; main()", "serve", "--data-dir", str(work / "data")],
                                env=env, stdout=subprocess.DEVNULL, stderr=log)
    if wait_for(lambda: admin_ready(port), 60, 0.2):
        return proc, f"http://127.0.0.1:{port}"
    proc.kill()
    raise SystemExit(f"serve never became ready:\n{(work / 'serve.log').read_text()[-3000:]}")


def run(rate: int, seconds: float, freeze: bool) -> dict[str, float]:
    """The GC metrics' change over the window (the longest and the frozen count as they are at its end)."""
    work = Path(tempfile.mkdtemp(prefix="tw-serve-gc-"))
    mq = LocalRocketMQ(work / "mq", stop_timeout=3.0)
    mq.start()
    try:
        mq.create_topics(["TW_DELAY", "TW_DLQ", "GC_TARGET"], queues=8)
        proc, base = _serve(mq, work, freeze)
        producer = RemotingProducer(mq.namesrv_addr, "bench-serve-gc")
        try:
            per = max(1, rate // 100)
            t0, sent, before = time.time(), 0, ""
            while time.time() - t0 < seconds + _WARM_S:
                if not before and time.time() - t0 >= _WARM_S:
                    before = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
                now = int(time.time() * 1000)
                producer.send_batch("TW_DELAY", [OutgoingMessage(
                    "TW_DELAY", b"x" * 200, None, None,
                    {"TW_TARGET_TOPIC": "GC_TARGET", "TW_DELIVER_AT_MS": str(now + 1000 + (sent + i) % 4000)})
                    for i in range(per)])
                sent += per
                time.sleep(max(0.0, t0 + sent / rate - time.time()))
            time.sleep(6)  # the last ones come due
            after = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
        finally:
            producer.close()
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:  # a stop that hangs is the engine's bug: said, and ended
                proc.kill()
                proc.wait()
                raise SystemExit(f"serve did not stop within 60 s of SIGTERM; see {work / 'serve.log'}")
        out: dict[str, float] = {}
        for family in _GC_FAMILIES:
            a, b = _samples(before, family), _samples(after, family)
            cumulative = "longest" not in family and "frozen" not in family
            out.update({k: round(v - (a.get(k, 0.0) if cumulative else 0.0), 4) for k, v in b.items()})
        return out
    finally:
        mq.stop()


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=int, default=3000, help="delay messages a second")
    ap.add_argument("--seconds", type=float, default=40.0, help="the window measured, after 10 s of warm-up")
    ap.add_argument("--no-freeze", action="store_true", help="serve without freezing its start's objects")
    args = ap.parse_args(argv)
    for name, value in run(args.rate, args.seconds, not args.no_freeze).items():
        print(f"{name} {value:g}")


if __name__ == "__main__":
    main()
