"""The workloads run with RocketMQ's own Java clients (`forwarder/java_client.py`): the high steady rate,
produced and consumed by them, and the two reference rows measuring the broker alone (what its Java
producer pushes in, what a no-op Java pull consumer reads out)."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from bench.peers.common import percentiles_of_quantiles
from bench.peers.cpu import CpuSampler, steady_window

if TYPE_CHECKING:
    from bench.peers.runner import Ids, RunConfig
    from bench.peers.systems import Sink, System

#: Both reference rows' topics; each row fills its own.
INTAKE_TOPIC = "PEER_INTAKE"
NOOP_TOPIC = "PEER_NOOP"
#: How the high steady rate is produced and consumed (said in the results and on the page).
PRODUCER = "RocketMQ's Java producer"
CONSUMER = "RocketMQ's Java push consumer"


def run_steady_java(system: System, sink: Sink, cfg: RunConfig, ids: Ids) -> dict[str, object]:
    """The high steady rate, end to end through RocketMQ's own Java clients: its producer paces small batches
    from 4 threads, and its push consumer (a fresh group on a topic nothing else reads) measures lateness.
    The harness's Python producer tops out below 10k/s on a small machine and its Python consumer saturates
    there, so the figure would be theirs; the floor it is compared with (the plain hop) runs the same way.

    The first `steady_high_warm_up_s` of the stream are not measured: cold JVMs (both clients start for the
    phase) put up to seconds of lateness on the first second's messages, over 1 % of a 20 s run, which
    would be the clients' p99, not the system's; for a delay system the stream is then in full flow (due
    times spread over the delay window) when the measured messages come due."""
    from forwarder.java_client import JavaClient

    rate, seconds, warm_s = cfg.steady_high_rate, cfg.steady_high_seconds, cfg.steady_high_warm_up_s
    n, warm = int(rate * seconds), int(rate * warm_s)
    base = int(ids.take(warm + n)[0])
    first = base + warm  # the warm-up's messages are numbered before the measured ones
    topic, target = system.paced_topics()
    read = target or topic
    mq = system.mq  # type: ignore[attr-defined]
    mq.create_topics([read], queues=8)
    sink.current = None  # nothing of this phase reaches the harness's own consumer
    java = JavaClient(mq.namesrv_addr)
    # from the producer's end: the engine may still be storing (up to 120 s), then the longest delay
    wait_s = 120 + cfg.delay_max_ms / 1000 + 60
    with java.lateness(read, (first, first + n), group=f"peers-java-{system.name}-{first}", wait_s=wait_s,
                       idle_s=20) as consumer, CpuSampler(system) as sampler:
        got = java.pace(topic, rate=rate, seconds=seconds, id_start=base, body_size=cfg.body_bytes, target=target,
                        delay_ms=(cfg.delay_min_ms, cfg.delay_max_ms), seed=cfg.seed, warm_up_s=warm_s)
        paced_until = time.monotonic()
        accepted, warm_sent = int(got["sent"]), int(got["warm_up_sent"])
        consumer.expect(accepted)
        system.wait_stored(accepted + warm_sent, 120)
        res = consumer.result(wait_s + 60)
    q = res["quantiles_ms"]
    out: dict[str, object] = {
        "rate": rate, "messages": n, "accepted": accepted, "failed": int(got["failed"]), "received": res["received"],
        "complete": res["complete"], "producer_rate": round(got["rate"]), "producer": PRODUCER, "consumer": CONSUMER,
        "topic": read, "lateness_ms": percentiles_of_quantiles(q, int(res["received"])),
        "duplicates": res["duplicates"], "warm_up_s": warm_s, "warm_up_sent": warm_sent,
        "warm_up_received": res["other"], "by_second": res["by_second"]}
    if q:
        out["quantiles_ms"] = q
    window = steady_window(sampler, paced_until, warm_s + seconds, cfg.delay_max_ms / 1000)
    if window is not None:
        out["steady_window"] = window
    return out


def run_intake_ceiling(mq: object, cfg: RunConfig) -> dict[str, object]:
    """RocketMQ's own Java producer, batches from several threads, into a plain topic: the broker's intake
    ceiling on this machine, the yardstick for ingest and dispatch rates."""
    from forwarder.java_client import JavaClient

    mq.create_topics([INTAKE_TOPIC], queues=8)  # type: ignore[attr-defined]
    java = JavaClient(mq.namesrv_addr)  # type: ignore[attr-defined]
    got = java.intake(INTAKE_TOPIC, seconds=cfg.intake_seconds, threads=cfg.intake_threads,
                      batch=cfg.intake_batch, body_size=cfg.body_bytes)
    return {"sent": int(got["sent"]), "seconds": round(got["seconds"], 2), "rate": round(got["rate"]),
            "threads": cfg.intake_threads, "batch": cfg.intake_batch}


def run_noop_consumer(mq: object, cfg: RunConfig) -> dict[str, object]:
    """A backlog filled as the intake ceiling fills its topic, then read from the first offset by RocketMQ's
    own lite pull consumer doing nothing with the messages: what the broker hands one consumer per second on
    this machine, the yardstick for the engine's ingest (which is a pull consumer too)."""
    from forwarder.java_client import JavaClient

    mq.create_topics([NOOP_TOPIC], queues=8)  # type: ignore[attr-defined]
    java = JavaClient(mq.namesrv_addr)  # type: ignore[attr-defined]
    filled = java.intake(NOOP_TOPIC, seconds=cfg.intake_seconds, threads=cfg.intake_threads,
                         batch=cfg.intake_batch, body_size=cfg.body_bytes)
    backlog = int(filled["sent"])
    got = java.noop(NOOP_TOPIC, backlog, group="peers-noop", batch=cfg.pull_batch, timeout_s=300 + backlog / 10_000)
    return {"backlog": backlog, "received": int(got["received"]), "seconds": round(got["seconds"], 2),
            "rate": round(got["rate"]), "wall_seconds": round(got["wall_seconds"], 2), "pull_batch": cfg.pull_batch,
            "queues": 8}
