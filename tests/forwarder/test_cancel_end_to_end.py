"""Cancels as control messages on the delay topic, through the real local RocketMQ.

A user's plain producer (the bundled client, not the engine's wire client) sends delay messages and
cancels; two engines read the delay topic in two consumer groups, as two replicas would, each into
its own data directory, and deliver to the same target topic.
"""
from __future__ import annotations

import dataclasses
import json
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from forwarder._rmq_native import NativeProducer, NativePushConsumer
from forwarder.config import RocketMQConfig
from forwarder.local_rocketmq import LocalRocketMQ
from forwarder.rocketmq import OutgoingMessage
from timewheel.app.service import Service
from timewheel.app.settings import AdminConfig, Settings
from timewheel.config import EngineConfig
from tests.forwarder.test_end_to_end import Inbox
from tests.polling import wait_for

pytestmark = pytest.mark.rocketmq
QUEUES = 4


@dataclass
class Pair:
    mq: LocalRocketMQ
    services: list[Service]
    settings: list[Settings]
    producer: NativeProducer
    inbox: Inbox
    delay_topic: str
    target: str

    def send(self, body: bytes, delay_ms: int, *, keys: str | None = None) -> str:
        """A delay message from the user's producer; its id as the producer got it back."""
        props = {"TW_TARGET_TOPIC": self.target, "TW_DELAY_MS": str(delay_ms)}
        return self.producer.send(OutgoingMessage(self.delay_topic, body, None, keys, props)).msg_id

    def cancel(self, **props: str) -> None:
        """A control message from the same plain producer: no target, one TW_CANCEL_* property."""
        # RocketMQ's clients refuse an empty body; the engine ignores it
        self.producer.send(OutgoingMessage(self.delay_topic, b"cancel", None, None, props))

    def stat(self, i: int, name: str) -> int:
        st = self.services[i].stats()
        value = st["ingest"][name] if name == "cancels_received" else st[name]  # type: ignore[index]
        return int(value)  # type: ignore[arg-type]

    def delivered(self) -> list[bytes]:
        return [m.body for m, _ in self.inbox.on(self.target)]


def _settings(rmq: RocketMQConfig, data_dir: Path, group: str, admin: bool) -> Settings:
    return Settings(engine=EngineConfig(data_dir, max_delay_ms=3_600_000),
                    rocketmq=dataclasses.replace(rmq, consumer_group=group),
                    admin=AdminConfig(listen="127.0.0.1:0", token="s3cret" if admin else ""))


@pytest.fixture(scope="module")
def pair(rocketmq: LocalRocketMQ, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    run = uuid.uuid4().hex[:8]
    rmq = RocketMQConfig(namesrv=rocketmq.namesrv_addr, delay_topic=f"TW_DELAY_C{run}",
                         dead_letter_topic=f"TW_DLQ_C{run}",
                         consumer_group=f"tw_replica_a_{run}", producer_group=f"tw_delivery_c{run}",
                         send_timeout_ms=2000)
    target = f"ORDERS_C{run}"
    rocketmq.create_topics([rmq.delay_topic, rmq.dead_letter_topic, target], queues=QUEUES)
    inbox = Inbox()
    consumer = NativePushConsumer(f"tw_cancel_consumer_{run}", rocketmq.namesrv_addr, inbox)
    consumer.subscribe(target)
    consumer.start()
    settings = [_settings(rmq, tmp_path_factory.mktemp("replica_a"), f"tw_replica_a_{run}", True),
                _settings(rmq, tmp_path_factory.mktemp("replica_b"), f"tw_replica_b_{run}", False)]
    services = [Service(s, admin=i == 0).start() for i, s in enumerate(settings)]
    producer = NativeProducer(f"tw_cancel_producer_{run}", rocketmq.namesrv_addr)
    producer.start()
    p = Pair(rocketmq, services, settings, producer, inbox, rmq.delay_topic, target)
    p.send(b"probe", 0)
    assert wait_for(lambda: p.delivered().count(b"probe") == 2, 90), "the pipeline never came up"
    yield p
    producer.shutdown()
    for s in p.services:
        s.stop()
    consumer.shutdown()


def _wait_applied(p: Pair, name: str, at_least: list[int]) -> None:
    assert wait_for(lambda: all(p.stat(i, name) >= n for i, n in enumerate(at_least)), 30), \
        f"{name}: {[p.stat(i, name) for i in range(2)]}, wanted {at_least}"


def test_a_cancel_by_id_from_a_plain_producer_is_never_delivered(pair: Pair) -> None:
    tag = uuid.uuid4().hex[:8].encode()
    before = [pair.stat(i, "cancel_requests") for i in range(2)]
    doomed = pair.send(b"doomed-" + tag, 6000)
    pair.send(b"kept-" + tag, 7000)  # due after the cancelled one: once it is here, the other would be too
    pair.cancel(TW_CANCEL_ID=doomed)
    _wait_applied(pair, "cancel_requests", [n + 1 for n in before])
    assert wait_for(lambda: pair.delivered().count(b"kept-" + tag) == 2, 30)
    time.sleep(0.5)
    assert b"doomed-" + tag not in pair.delivered()


def test_a_cancel_by_key_sent_before_the_message_wins(pair: Pair) -> None:
    key = f"order-{uuid.uuid4().hex[:8]}"
    before = [pair.stat(i, "cancel_requests") for i in range(2)]
    on_arrival = [pair.stat(i, "cancelled_on_arrival") for i in range(2)]
    pair.cancel(TW_CANCEL_KEY=key)
    _wait_applied(pair, "cancel_requests", [n + 1 for n in before])
    pair.send(b"late-" + key.encode(), 1000, keys=f"x {key}")
    pair.send(b"kept-" + key.encode(), 2000, keys="other")
    assert wait_for(lambda: pair.delivered().count(b"kept-" + key.encode()) == 2, 30)
    time.sleep(0.5)
    assert b"late-" + key.encode() not in pair.delivered()
    assert [pair.stat(i, "cancelled_on_arrival") for i in range(2)] == [n + 1 for n in on_arrival]


def _holds(service: Service, msg_id: str) -> bool:
    """Whether a replica has stored the message (its id, under any suffix)."""
    engine = service.engine
    return engine is not None and engine.store is not None and bool(engine.store.meta.ids_with_prefix(msg_id))


@pytest.mark.slow
def test_a_restart_between_the_cancel_and_the_due_time_keeps_it(pair: Pair) -> None:
    key = f"order-{uuid.uuid4().hex[:8]}"
    stored = pair.send(b"stored-" + key.encode(), 15_000, keys=key)
    assert wait_for(lambda: all(_holds(s, stored) for s in pair.services), 30)
    before = [pair.stat(i, "cancel_requests") for i in range(2)]
    pair.cancel(TW_CANCEL_KEY=key)
    _wait_applied(pair, "cancel_requests", [n + 1 for n in before])
    for i in range(2):  # both replicas restart on their data directories
        pair.services[i].stop()
        pair.services[i] = Service(pair.settings[i], admin=i == 0).start()
    assert all(pair.stat(i, "tombstones") >= 1 for i in range(2))
    pair.send(b"after-" + key.encode(), 1000, keys=key)  # the tombstone came back from disk
    pair.send(b"kept-" + key.encode(), 16_000)
    assert wait_for(lambda: pair.delivered().count(b"kept-" + key.encode()) == 2, 60)
    time.sleep(0.5)
    got = pair.delivered()
    assert b"stored-" + key.encode() not in got and b"after-" + key.encode() not in got


def test_the_admin_cancel_reaches_every_queue_and_both_replicas(pair: Pair) -> None:
    tag = uuid.uuid4().hex[:8].encode()
    admin = pair.services[0].admin
    assert admin is not None
    doomed = pair.send(b"admin-doomed-" + tag, 8000)
    pair.send(b"admin-kept-" + tag, 9000)
    assert wait_for(lambda: all(s.engine is not None and s.engine.store is not None
                                and s.engine.store.meta.ids_with_prefix(doomed) for s in pair.services), 30)
    received = [pair.stat(i, "cancels_received") for i in range(2)]
    req = urllib.request.Request(f"http://{admin.address}/cancel?id={doomed}", method="POST",
                                 headers={"Authorization": "Bearer s3cret"})
    # two engines without [ha]: each sends what it stores, so the answer is a promise
    assert json.loads(urllib.request.urlopen(req, timeout=10).read()) == {"cancelled": 1, "applied_on": "engine",
                                                                          "promise": True}
    # one copy on each queue of the delay topic, read by each replica whatever queues it owns
    _wait_applied(pair, "cancels_received", [n + QUEUES for n in received])
    assert wait_for(lambda: pair.delivered().count(b"admin-kept-" + tag) == 2, 30)
    time.sleep(0.5)
    assert b"admin-doomed-" + tag not in pair.delivered()
    assert [pair.stat(i, "cancels_received") for i in range(2)] == [n + QUEUES for n in received]
    assert all(pair.stat(i, "cancelled") >= 1 for i in range(2))
