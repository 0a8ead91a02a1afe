"""A shard served by two `timewheel serve` replicas on a real RocketMQ and a real ZooKeeper.

Replica `a` starts first and holds the shard's lease; replica `b` consumes the same queues into
its own data directory under its own consumer group, and delivers nothing. Delay messages flow at
a steady rate (due 1-6 s after sending, and one in five already 1-60 s past due when sent, as an
outbox relay draining a backlog sends them); a consumer of the target topic counts deliveries by
TW_ORIGINAL_MSG_ID and notes each one's TW_LEASE_EPOCH and when and where the broker stored it. Then:

(a) `a` is killed with SIGKILL: `b` takes the lease once ZooKeeper expires `a`'s session and
    delivers everything due after the last watermark `a` published;
(b) `a` is paused with SIGSTOP past its session and resumed: `b` took over meanwhile, and `a`
    sends nothing after it resumes (its fencing deadline passed while it was stopped) but the one
    send batch a pause between its fence's last look and the write lets out (docs/HA.md).

Before the failure, a plain producer cancels a few messages through the delay topic (TW_CANCEL_ID);
they are due after the failure, and the replica that holds the lease then delivers none of them.

Asserted, as docs/HA.md states it: nothing acknowledged is lost; the lease changes hands within
10 s; every duplicate was due between the watermark `b` took over from and the failure (or, past
due when sent, was sent within about an interval before the failure), and that
window is printed (about two watermark intervals on a quiet machine: a past-due message in the
dispatch queue at the moment of a publication holds that one back; wider under load) and must show
a watermark that kept moving; nothing carries the paused engine's epoch after it resumes but that
one batch (one store time, one queue, one run of queue offsets). The figures are printed.
"""
from __future__ import annotations

import json
import signal
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from coordination import LocalZooKeeper
from forwarder._rmq_native import LogLevel, NativeProducer, NativePushConsumer
from forwarder.contract import ORIGINAL_MSG_ID
from forwarder.errors import ForwarderError
from forwarder.local_rocketmq import LocalRocketMQ
from forwarder.rocketmq import OutgoingMessage, Receipt, ReceivedMessage, RemotingProducer
from tests.coordination.cluster import (Delivery, Replica, at_most_one_send_batch, now_ms as _now_ms, stored_where,
                                        wait_for as _wait)
from tests.forwarder.dedupe_checker import TopicReader
from tests.reliability.kill_loop import serve_env
from timewheel.app.cli import app

pytestmark = [pytest.mark.rocketmq, pytest.mark.slow]

RATE = 200  # delay messages a second
DELAY_MS = (1_000, 6_000)
SESSION_S = 4.0
WATERMARK_S = 1.0
PUBLISH_SLACK_MS = 500  # computing and writing a watermark on a busy two-core machine
STALLED_WATERMARK_S = 10.0  # a watermark further behind the failure than this stopped moving
TAKEOVER_BOUND_S = 10.0
CANCELLED_DUE_S = 18  # after the failure, within the run: delivered by b unless the cancel reached it


def _run(rocketmq: LocalRocketMQ, zookeeper: LocalZooKeeper, work: Path, failure: str) -> None:
    run = uuid.uuid4().hex[:8]
    delay_topic, target = f"TW_DELAY_{run}", f"HA_{run}"
    rocketmq.create_topics([delay_topic], queues=4)
    rocketmq.create_topics([f"TW_DLQ_{run}", target])
    env = serve_env(rocketmq, run, TIMEWHEEL_HA_ZOOKEEPER=zookeeper.connect_string,
                    TIMEWHEEL_HA_SESSION_TIMEOUT_S=str(SESSION_S), TIMEWHEEL_HA_WATERMARK_INTERVAL_S=str(WATERMARK_S))
    lock = threading.Lock()
    receipts: Counter[bytes] = Counter()
    epochs: dict[bytes, list[Delivery]] = {}  # body -> its copies: epoch, and when and where the broker stored each

    def on_delivery(m: ReceivedMessage) -> bool:
        with lock:
            receipts[m.body] += 1
            epochs.setdefault(m.body, []).append(Delivery.of(m))
        assert m.properties.get(ORIGINAL_MSG_ID)
        return True

    consumer = NativePushConsumer(f"ha_consumer_{run}", rocketmq.namesrv_addr, on_delivery, log_level=LogLevel.ERROR)
    consumer.subscribe(target)
    consumer.start()
    producer = NativeProducer(f"ha_producer_{run}", rocketmq.namesrv_addr, log_level=LogLevel.ERROR)
    producer.start()
    due_of: dict[bytes, int] = {}
    acked: set[bytes] = set()
    cancelled: set[bytes] = set()
    past_due: dict[bytes, int] = {}  # body -> when it was sent
    stop = threading.Event()
    a = b = None
    try:
        a = Replica("a", work, env).wait_ready()
        _wait("a holds the lease", a.holds, 30, a)
        b = Replica("b", work, env).wait_ready()
        epoch_a = a.replica()["epoch"]

        def produce() -> None:
            t0, i = time.monotonic(), 0
            while not stop.is_set():
                body = f"{run}-{i}".encode()
                due = _now_ms() + DELAY_MS[0] + (i * 7919) % (DELAY_MS[1] - DELAY_MS[0])
                if i % 5 == 0:  # one in five already 1-60 s past due (a relay draining a backlog, a retry)
                    due = _now_ms() - 1_000 - (i * 7919) % 59_000
                    past_due[body] = _now_ms()
                for _ in range(10):
                    try:
                        producer.send(OutgoingMessage(delay_topic, body, None, None, {
                            "TW_TARGET_TOPIC": target, "TW_DELIVER_AT_MS": str(due)}))
                        due_of[body] = due
                        acked.add(body)
                        break
                    except ForwarderError:
                        time.sleep(0.1)
                i += 1
                time.sleep(max(0.0, t0 + i / RATE - time.monotonic()))

        producer_thread = threading.Thread(target=produce, daemon=True)
        producer_thread.start()
        time.sleep(12.0)  # steady state: a delivers, b stores and follows a's watermark
        # Messages due well after the failure, cancelled at once by a plain producer through the delay topic
        # (the shard holds every queue, so one control message each reaches both replicas).
        for k in range(5):
            body = f"{run}-cancelled-{k}".encode()
            msg_id = producer.send(OutgoingMessage(delay_topic, body, None, None, {
                "TW_TARGET_TOPIC": target, "TW_DELAY_MS": str(CANCELLED_DUE_S * 1000)})).msg_id
            producer.send(OutgoingMessage(delay_topic, b"cancel", None, None, {"TW_CANCEL_ID": msg_id}))
            cancelled.add(body)
        assert not b.holds()
        with lock:
            assert receipts and all(d.epoch == epoch_a for v in epochs.values() for d in v)
        failed_ms = _now_ms()
        if failure == "kill":
            a.proc.send_signal(signal.SIGKILL)
        else:
            a.proc.send_signal(signal.SIGSTOP)
        t_fail = time.monotonic()
        _wait("b holds the lease", b.holds, 30, b)
        takeover_s = time.monotonic() - t_fail
        took_over = b.replica()
        shown = CliRunner().invoke(app, ["status", "--admin", f"127.0.0.1:{b.port}", "--json"])
        assert shown.exit_code == 0, shown.output
        shard = json.loads(shown.output)["ha"]["shards"][0]
        assert (shard["holder"], shard["epoch"]) == ("b", took_over["epoch"]) and shard["lag_ms"] is not None
        screen = " ".join(CliRunner().invoke(app, ["status", "--admin", f"127.0.0.1:{b.port}"]).output.split())
        assert f"replica b of shard 0/1: HOLDS the lease, epoch {took_over['epoch']}" in screen
        resumed_ms = None
        if failure == "pause":
            time.sleep(max(0.0, t_fail + SESSION_S + 3.0 - time.monotonic()))  # well past a's session
            a.proc.send_signal(signal.SIGCONT)
            resumed_ms = _now_ms()
            _wait("a answers again, as a standby", lambda: not a.holds() and a.replica()["epoch"] == 0, 30, a)
        time.sleep(10.0)  # b delivers on, under its epoch
        stop.set()
        producer_thread.join(30)
        last_due = max(due_of.values())
        # b's sends take 20-50 ms on a slow two-core machine while it drains a's backlog (a CI run
        # timed out at 30 s after the last due time): it gets 90 s
        try:
            _wait("every acknowledged message delivered", lambda: acked <= set(receipts),
                  max(90.0, (last_due - _now_ms()) / 1000 + 90), b)
        except AssertionError as timed_out:
            missing = acked - set(receipts)
            raise AssertionError(_missing(missing, len(acked), due_of, past_due, failed_ms)
                                 + _on_broker(rocketmq.namesrv_addr, target, missing, failed_ms)
                                 + _on_delay_topic(rocketmq.namesrv_addr, delay_topic, missing, failed_ms)
                                 + f"\n{timed_out}") from None
        time.sleep(2.0)  # a late duplicate shows up before counting
        after = b.replica()
        after_a = a.replica() if failure == "pause" else None
    finally:
        stop.set()
        for r in (a, b):
            if r is not None:
                r.stop()
        producer.shutdown()
        consumer.shutdown()

    with lock:
        counts, seen = dict(receipts), {k: list(v) for k, v in epochs.items()}
    epoch_b = took_over["epoch"]
    watermark = took_over["peer_watermark_ms"]
    dups = [body for body, c in counts.items() if c > 1]
    window = [body for body, due in due_of.items() if watermark < due <= failed_ms]
    lost = acked - set(counts)
    # docs/HA.md (fencing): a SIGSTOP between the fence's last look at the clock and the write sends
    # that one batch on resuming (one store time, one queue, one run of offsets). More is a bug.
    after_resume = [d for v in seen.values() for d in v
                    if d.epoch == epoch_a and resumed_ms is not None and d.store_ms >= resumed_ms]
    print(f"\nreplica set, {failure}: acknowledged {len(acked)}, delivered {len(counts)}, lost {len(lost)}; "
          f"takeover {takeover_s:.2f} s after the {'SIGKILL' if failure == 'kill' else 'SIGSTOP'} "
          f"(session {SESSION_S:g} s); epochs {epoch_a} -> {epoch_b}; the watermark b took over from was "
          f"{failed_ms - watermark} ms before the failure; {len(dups)} duplicates (messages due in that window: "
          f"{len(window)}; b counted {after['possible_duplicates']} possible); b recorded "
          f"{after['peer_delivered']} as delivered by a; {len(cancelled & set(counts))} of {len(cancelled)} "
          "cancelled through the delay topic delivered"
          + (f"; a sent {len(after_resume)} after resuming ({stored_where(after_resume) or 'none'}) and is a "
             f"standby (epoch {after_a['epoch']})" if after_a is not None else ""))
    assert not lost, f"{len(lost)} acknowledged messages never delivered, e.g. {sorted(lost)[:5]}"
    assert len(cancelled) == 5 and not cancelled & set(counts), "a message cancelled through the delay topic arrived"
    assert takeover_s <= TAKEOVER_BOUND_S
    assert epoch_b > epoch_a
    # A message already past due holds W at its due time for the moment it is in the dispatch queue,
    # and a publication that falls in that moment is skipped (W never moves back): about two intervals
    # on a quiet machine, more when sends are slow and past-due arrivals keep the queue busy (3.5 s
    # in a CI run on a loaded two-core machine; docs/HA.md). The window is printed; what is asserted
    # is that W kept moving (a holder that stopped publishing lags by the whole run), and below that
    # every duplicate lies inside the window, however wide.
    assert failed_ms - watermark <= STALLED_WATERMARK_S * 1000, f"W lagged {failed_ms - watermark} ms"
    # a past-due message is covered by a's mark only if a had stored it when it published: those sent
    # within about an interval before the failure may go out twice, none sent earlier
    # (the mark was published at or after its W: a past-due message sent a second or more before
    # both the mark's W and an interval before the failure was stored, and covered, by then)
    recent_ms = min(failed_ms - WATERMARK_S * 1000 - PUBLISH_SLACK_MS, watermark) - 1_000
    stray = [b for b in dups if not (watermark < due_of[b] <= failed_ms or past_due.get(b, 0) >= recent_ms)]
    assert not stray, f"duplicates due outside (watermark, failure]: {stray[:5]}"
    assert all(counts[b] == 2 for b in dups)
    assert len([b for b in dups if b not in past_due]) <= len(window)
    late_after = [b for b, sent in past_due.items() if sent > failed_ms]
    print(f"past due when sent: {len(past_due)}, {len(late_after)} of them after the failure, "
          f"{len(set(late_after) - set(counts))} of those lost")
    assert all(d.epoch == epoch_b or d in after_resume
               for v in seen.values() for d in v if d.store_ms > failed_ms + 1_000), \
        "only b's epoch after the failure (and a's one batch in flight at the pause)"
    if failure == "pause":
        assert at_most_one_send_batch(after_resume), (f"the paused engine sent {len(after_resume)} after resuming, "
                                                      f"not one send batch: {stored_where(after_resume)}")
        assert after_a is not None and not after_a["holder"]


def _missing(missing: set[bytes], acked: int, due_of: dict[bytes, int], past_due: dict[bytes, int],
             failed_ms: int) -> str:
    """Which acknowledged messages never arrived, each with its due (and send) time from the failure."""
    shown = []
    for body in sorted(missing, key=lambda b: due_of[b])[:12]:
        sent = f", sent {past_due[body] - failed_ms:+d} ms already past due" if body in past_due else ""
        shown.append(f"{body.decode()} due {due_of[body] - failed_ms:+d} ms{sent}")
    return (f"{len(missing)} of {acked} acknowledged messages not delivered (times from the failure): "
            + "; ".join(shown))


def _on_broker(namesrv: str, topic: str, missing: set[bytes], failed_ms: int) -> str:
    """Whether the messages the consumer never got are on the target topic all the same (then the
    engine delivered them and the test's consumer missed them) or not (then they were lost)."""
    stored = {c.body: c for c in TopicReader(namesrv, topic).read() if c.body in missing}
    shown = [f"{b.decode()} stored {c.store_ms - failed_ms:+d} ms, epoch {c.epoch}, at {c.where}"
             for b, c in sorted(stored.items())[:12]]
    return (f"\nof those, {len(stored)} are on the broker's {topic} (the consumer missed them)"
            + (": " + "; ".join(shown) if shown else "") + f" and {len(missing) - len(stored)} are not (lost)")


def _on_delay_topic(namesrv: str, topic: str, missing: set[bytes], failed_ms: int) -> str:
    """Whether the broker holds the lost messages on the delay topic: if not, the producer's
    acknowledgement was for a message the broker does not have; if so, the engines' ingest did not
    store it (their data directories then say whether it reached a part or an ingest log)."""
    on = {c.body: c for c in TopicReader(namesrv, topic).read() if c.body in missing}
    shown = [f"{b.decode()} stored {c.store_ms - failed_ms:+d} ms as {c.msg_id} at {c.where}"
             for b, c in sorted(on.items())[:12]]
    return (f"\non the delay topic {topic}: {len(on)} of them" + (": " + "; ".join(shown) if shown else "")
            + f", {len(missing) - len(on)} not there")


def test_a_standby_takes_over_from_a_killed_replica(rocketmq: LocalRocketMQ, zookeeper: LocalZooKeeper,
                                                    tmp_path: Path) -> None:
    _run(rocketmq, zookeeper, tmp_path, "kill")


def test_a_paused_replica_sends_at_most_its_batch_in_flight_after_resuming_and_the_standby_took_over(
        rocketmq: LocalRocketMQ, zookeeper: LocalZooKeeper, tmp_path: Path) -> None:
    _run(rocketmq, zookeeper, tmp_path, "pause")


def test_two_shards_split_the_queues_and_each_delivers_its_own_once(rocketmq: LocalRocketMQ,
                                                                    zookeeper: LocalZooKeeper, tmp_path: Path) -> None:
    run = uuid.uuid4().hex[:8]
    delay_topic, target = f"TW_DELAY_{run}", f"HA_{run}"
    rocketmq.create_topics([delay_topic], queues=4)
    rocketmq.create_topics([f"TW_DLQ_{run}", target])
    env = serve_env(rocketmq, run, TIMEWHEEL_HA_ZOOKEEPER=zookeeper.connect_string, TIMEWHEEL_HA_SHARDS="2")
    lock = threading.Lock()
    queues_of: dict[int, set[int]] = {}  # shard -> the delay-topic queues the producer's batches went to
    receipts: Counter[bytes] = Counter()

    def on_delivery(m: ReceivedMessage) -> bool:
        with lock:
            receipts[m.body] += 1
        return True

    consumer = NativePushConsumer(f"ha_consumer_{run}", rocketmq.namesrv_addr, on_delivery, log_level=LogLevel.ERROR)
    consumer.subscribe(target)
    consumer.start()
    shards: list[Replica] = []
    try:
        shards = [Replica(f"s{k}", tmp_path, env, TIMEWHEEL_HA_SHARD=str(k)).wait_ready() for k in range(2)]
        _wait("each shard has its holder", lambda: all(r.holds() for r in shards), 30)
        bodies = [f"{run}-{i}".encode() for i in range(400)]
        with RemotingProducer(rocketmq.namesrv_addr, f"ha_producer_{run}", max_batch_messages=10) as producer:
            due = _now_ms() + 2_000
            receipts_out = producer.send([OutgoingMessage(delay_topic, b, None, None, {
                "TW_TARGET_TOPIC": target, "TW_DELIVER_AT_MS": str(due)}) for b in bodies])
        for r in receipts_out:
            assert isinstance(r, Receipt), r
            queues_of.setdefault(r.queue_id % 2, set()).add(r.queue_id)
        assert queues_of == {0: {0, 2}, 1: {1, 3}}
        _wait("every message delivered", lambda: len(receipts) == len(bodies), 60)
        time.sleep(2.0)  # a second copy would show up by now
        # /status asks the NameServer, the brokers and ZooKeeper: on a loaded machine more than the default 2 s
        stored = [r.status(timeout=30)["scheduled"] for r in shards]
        doc = shards[0].status(timeout=30)["ha"]
    finally:
        for replica in shards:
            replica.stop()
        consumer.shutdown()
    print(f"\ntwo shards: stored {stored}, {sum(receipts.values())} deliveries of {len(receipts)} messages")
    assert set(receipts) == set(bodies) and set(receipts.values()) == {1}
    assert sum(stored) == len(bodies) and all(n > 0 for n in stored)  # each shard stored its queues only
    assert [(s["shard"], s["holder"]) for s in doc["shards"]] == [(0, "s0"), (1, "s1")]
