"""What RocketMQ message trace costs the engine: CPU per message with `[rocketmq] trace` off and on.

    python -m bench.trace_cost [--messages 50000] [--rounds 3] [--namesrv HOST:PORT]

Against a real RocketMQ (a local one is started unless --namesrv is given), in this process:
- delivery: --messages stored records (100-byte bodies, two keys, tags) read as the dispatcher reads
  them (`ScheduleStore.read_record_bytes`, batches of 128) and sent by the delivery sink
  (`RocketMQSink.send_records`), plain, then through `forwarder.trace.TracingSink` whose
  `TraceWriter` sends the produce records to a trace topic (its thread's work and the flush at the
  end included);
- ingest: the consume records of --messages messages (`TraceWriter.consumed` in batches of 1024,
  as `traced_schedule` writes them after each stored batch), sent and flushed; the store's own
  cost is not in it (it is the same with trace on and off).
CPU is this process's (`time.process_time`, every thread), so the broker's work is not counted:
it stores one trace message per 100 records. Rounds alternate off and on; the figures are medians.
Writes bench/results/trace_cost.json; bench/RESULTS_FIND.md holds the figures of record.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Sequence

import numpy as np

from bench.engine_latency import _machine
from forwarder import LocalRocketMQ
from forwarder.config import RocketMQConfig
from forwarder.delivery import RocketMQSink
from forwarder.rocketmq import RemotingProducer
from forwarder.trace import TraceWriter, TracingSink
from storage import Record, RecordBytes, ScheduleStore
from timewheel.message import Message

T0 = 1_800_000_000_000
SEND_BATCH = 128


def _records(store: ScheduleStore, n: int, run: str) -> list[RecordBytes]:
    """Store n records for ORDERS_<run>; their send batches as the dispatcher reads them."""
    recs = [Record(f"{i:032X}:0000abcd", f"ORDERS_{run}", bytes(100), T0 + i, tags="t",
                   keys=(f"order-{i}", "bench")) for i in range(n)]
    store.append(recs, T0 - 1000)
    seg = store.layout.segment_start(T0)
    ix = store.segment_index(seg)
    out: list[RecordBytes] = []
    for s in range(0, len(ix), SEND_BATCH):
        e = slice(s, s + SEND_BATCH)
        out.append(store.read_record_bytes(np.full(len(ix.offset[e]), seg, np.int64), ix.part[e], ix.offset[e],
                                           ix.due_ms[e]))
    return out


def _deliver(sink: RocketMQSink, batches: list[RecordBytes], trace: TraceWriter | None) -> float:
    """CPU seconds to send every batch (and flush the trace)."""
    send = TracingSink(sink, trace, lambda: int(time.time() * 1000)) if trace is not None else sink
    cpu = time.process_time()
    for b in batches:
        ok = send.send_records(b)
        assert all(ok), "a send failed: the figures would not mean anything"
    if trace is not None:
        trace.stop()
    return time.process_time() - cpu


def _ingest(trace: TraceWriter, n: int) -> float:
    """CPU seconds to write and send the consume records of n messages."""
    msgs = [Message("ORDERS", bytes(100), T0, "t", (f"order-{i}", "bench"), None, f"{i:032X}:0000abcd")
            for i in range(n)]
    cpu = time.process_time()
    for s in range(0, n, 1024):
        now = int(time.time() * 1000)
        trace.consumed(msgs[s:s + 1024], now, now)
    trace.stop()
    return time.process_time() - cpu


def run(namesrv: str, mq: LocalRocketMQ | None, messages: int, rounds: int) -> dict[str, object]:
    """Alternate rounds off and on; CPU microseconds per message."""
    run_id = uuid.uuid4().hex[:8]
    cfg = RocketMQConfig(namesrv=namesrv, producer_group=f"bench_delivery_{run_id}", send_threads=1)
    trace_topic = f"BENCH_TRACE_{run_id}"
    if mq is not None:
        mq.create_topics([f"ORDERS_{run_id}", trace_topic])
    producer = RemotingProducer(namesrv, cfg.producer_group)
    sink = RocketMQSink(cfg, producer)
    off: list[float] = []
    on: list[float] = []
    consume: list[float] = []
    lost = 0
    with tempfile.TemporaryDirectory(prefix="tw-trace-bench-") as d:
        store = ScheduleStore(Path(d))
        batches = _records(store, messages, run_id)
        _deliver(sink, batches[:8], None)  # routes and connections up before anything is measured
        for _ in range(rounds):
            off.append(_deliver(sink, batches, None) / messages * 1e6)
            writer = TraceWriter(producer, trace_topic, "bench-ingest", cfg.producer_group).start()
            on.append(_deliver(sink, batches, writer) / messages * 1e6)
            lost += writer.counters["dropped"] + writer.counters["failed"]
            writer = TraceWriter(producer, trace_topic, "bench-ingest", cfg.producer_group).start()
            consume.append(_ingest(writer, messages) / messages * 1e6)
            lost += writer.counters["dropped"] + writer.counters["failed"]
        store.close()
    sink.close()
    producer.close()
    med = {k: round(statistics.median(v), 2) for k, v in (("off", off), ("on", on), ("consume", consume))}
    return {"machine": _machine(), "messages": messages, "rounds": rounds,
            "delivery_cpu_us_per_message": {"trace_off": med["off"], "trace_on": med["on"],
                                             "added": round(med["on"] - med["off"], 2),
                                             "rounds_off": [round(x, 2) for x in off],
                                             "rounds_on": [round(x, 2) for x in on]},
            "ingest_consume_record_cpu_us_per_message": med["consume"], "trace_records_lost": lost}


def main(argv: Sequence[str] | None = None) -> None:
    """Parse arguments, run, print and save the figures."""
    ap = argparse.ArgumentParser(prog="python -m bench.trace_cost", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=50_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--namesrv", help="an existing NameServer (topics are created on first send)")
    ap.add_argument("--out", type=Path, default=Path("bench/results/trace_cost.json"))
    args = ap.parse_args(argv)
    if args.namesrv:
        result = run(args.namesrv, None, args.messages, args.rounds)
    else:
        with LocalRocketMQ(stop_timeout=3.0) as mq:
            result = run(mq.namesrv_addr, mq, args.messages, args.rounds)
    text = json.dumps(result, indent=2)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
