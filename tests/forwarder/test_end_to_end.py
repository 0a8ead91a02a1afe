"""Producer -> delay topic -> engine -> target topic, through the real local RocketMQ."""
from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from forwarder._rmq_native import NativeProducer, NativePushConsumer
from forwarder.rocketmq import OutgoingMessage, ReceivedMessage
from forwarder.local_rocketmq import LocalRocketMQ
from forwarder.config import RocketMQConfig
from timewheel.config import EngineConfig
from timewheel.app.service import Service
from timewheel.app.settings import AdminConfig, Settings
from tests.polling import wait_for
from tests.stored_copies import StoredCopies

pytestmark = pytest.mark.rocketmq


class Inbox:
    """Messages received on some topics, with the wall time each arrived."""

    def __init__(self) -> None:
        self.items: list[tuple[ReceivedMessage, int]] = []
        self.lock = threading.Lock()

    def __call__(self, msg: ReceivedMessage) -> bool:
        with self.lock:
            self.items.append((msg, time.time_ns() // 1_000_000))
        return True

    def on(self, topic: str) -> list[tuple[ReceivedMessage, int]]:
        with self.lock:
            return [(m, t) for m, t in self.items if m.topic == topic]


@dataclass
class World:
    mq: LocalRocketMQ
    service: Service
    producer: NativeProducer
    inbox: Inbox
    cfg: RocketMQConfig
    targets: tuple[str, str]

    def send_delayed(self, target: str | None, body: bytes, *, tags: str | None = None, keys: str | None = None,
                     **props: str) -> None:
        p = dict(props)
        if target is not None:
            p["TW_TARGET_TOPIC"] = target
        self.producer.send(OutgoingMessage(self.cfg.delay_topic, body, tags, keys, p))


@pytest.fixture(scope="module")
def world(rocketmq: LocalRocketMQ, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """The whole pipeline: a user's producer and consumer (the bundled client) around the engine."""
    run = uuid.uuid4().hex[:8]
    cfg = RocketMQConfig(namesrv=rocketmq.namesrv_addr, delay_topic=f"TW_DELAY_{run}", dead_letter_topic=f"TW_DLQ_{run}",
                         consumer_group=f"tw_ingest_{run}", producer_group=f"tw_delivery_{run}",
                         breaker_failures=5, breaker_open_seconds=1.0, send_timeout_ms=2000)
    targets = (f"ORDERS_{run}", f"PAYMENTS_{run}")
    rocketmq.create_topics([cfg.delay_topic, cfg.dead_letter_topic, *targets])
    inbox = Inbox()
    consumer = NativePushConsumer(f"tw_test_consumer_{run}", rocketmq.namesrv_addr, inbox)
    for t in (*targets, cfg.dead_letter_topic):
        consumer.subscribe(t)
    consumer.start()
    settings = Settings(engine=EngineConfig(tmp_path_factory.mktemp("e2e"), max_delay_ms=3_600_000,
                                            retry_base_ms=200, retry_max_ms=2000, max_attempts=100),
                        rocketmq=cfg, admin=AdminConfig(listen="127.0.0.1:0", token="s3cret"))
    service = Service(settings).start()
    producer = NativeProducer(f"tw_test_producer_{run}", rocketmq.namesrv_addr)
    producer.start()
    w = World(rocketmq, service, producer, inbox, cfg, targets)
    # both consumers are up once a probe goes all the way through
    w.send_delayed(targets[0], b"probe", TW_DELAY_MS="0")
    assert wait_for(lambda: any(m.body == b"probe" for m, _ in inbox.on(targets[0])), 90), "pipeline never came up"
    yield w
    producer.shutdown()
    service.stop()
    consumer.shutdown()


def test_delays_from_0_to_10s_arrive_once_with_everything_intact(world: World) -> None:
    sent = {}
    for i in range(20):
        body = f"order-{i}-ü".encode() + bytes([0, 255, i])
        target = world.targets[i % 2]
        delay = i * 500
        world.send_delayed(target, body, tags=f"tag{i % 3}", keys=f"k{i} order-{i}", TW_DELAY_MS=str(delay),
                           customer="Zoë", note=f"n{i}")
        sent[body] = (target, delay)
    def arrived() -> list[tuple[ReceivedMessage, int]]:
        return [(m, t) for m, t in world.inbox.on(world.targets[0]) + world.inbox.on(world.targets[1])
                if m.body in sent]
    assert wait_for(lambda: len(arrived()) >= 20, 60)
    time.sleep(1.0)  # anything delivered twice would show up now
    got = arrived()
    # once = one copy stored on the target; the test's push consumer may hand a copy over twice
    copies: StoredCopies[bytes] = StoredCopies()
    for m, _ in got:
        copies.add(m.body, m)
    assert copies.keys() == set(sent), "each message delivered"
    assert copies.duplicates() == 0, f"each message stored on its target once: {copies.described()}"
    for m, received_ms in got:
        target, delay = sent[m.body]
        i = int(m.body.split(b"-")[1])
        assert m.topic == target
        assert m.tags == f"tag{i % 3}" and m.keys == f"k{i} order-{i}"
        assert m.properties["customer"] == "Zoë" and m.properties["note"] == f"n{i}"
        uniq, _, digest = m.properties["TW_ORIGINAL_MSG_ID"].partition(":")
        assert len(uniq) == 32 and len(digest) == 8
        due = int(m.properties["TW_DUE_MS"])
        assert received_ms >= due, "never delivered before its due time"
        assert "TW_TARGET_TOPIC" not in m.properties and "TW_DELAY_MS" not in m.properties
    # what the broker stored for a producer's ordinary messages is read in one pass
    assert world.service.stats()["ingest"]["one_pass"] >= 20  # type: ignore[index]


@pytest.mark.parametrize("props,reason", [
    ({}, "no TW_TARGET_TOPIC"),
    ({"TW_TARGET_TOPIC": "X", "TW_DELIVER_AT_MS": "tomorrow"}, "not an integer"),
    ({"TW_TARGET_TOPIC": "X", "TW_DELAY_MS": "-5"}, "negative"),
    ({"TW_TARGET_TOPIC": "X", "TW_DELAY_MS": str(10 * 3_600_000)}, "maximum delay"),
    ({"TW_TARGET_TOPIC": "bad topic!", "TW_DELAY_MS": "0"}, "not a valid topic"),
    ({"TW_TARGET_TOPIC": "X"}, "no due time"),
    # a dead letter keeping this property would exceed RocketMQ's 32767 bytes: it goes minimal
    ({"BIG": "x" * 32_600}, "no TW_TARGET_TOPIC"),
    # accepted, it could never be delivered: the engine's own properties would push it past 32767
    ({"TW_TARGET_TOPIC": "X", "TW_DELAY_MS": "0", "BIG": "x" * 32_590}, "32767"),
])
def test_contract_breaking_messages_are_dead_lettered_with_reason(world: World, props: dict[str, str],
                                                                  reason: str) -> None:
    body = f"bad-{uuid.uuid4().hex}".encode()
    props = dict(props)  # the parameter is shared by both worlds
    target = props.pop("TW_TARGET_TOPIC", None)
    world.send_delayed(target, body, **props)
    dlq = world.cfg.dead_letter_topic
    assert wait_for(lambda: any(m.body == body for m, _ in world.inbox.on(dlq)), 60)
    [m] = [m for m, _ in world.inbox.on(dlq) if m.body == body]
    assert reason in m.properties["TW_DEAD_LETTER_REASON"]
    assert world.service.stats()["ingest"]["dead_lettered"] >= 1  # type: ignore[index]


@pytest.mark.slow
def test_broker_restart_mid_dispatch_loses_nothing(world: World) -> None:
    bodies = [f"restart-{i}-{uuid.uuid4().hex[:6]}".encode() for i in range(200)]
    start = time.time_ns() // 1_000_000 + 3000
    for i, b in enumerate(bodies):
        world.send_delayed(world.targets[1], b, TW_DELIVER_AT_MS=str(start + i * 25))
    assert wait_for(lambda: world.service.stats()["scheduled"] >= 200, 60)  # type: ignore[operator]
    time.sleep(max(0.0, (start + 1500) / 1000 - time.time()))  # mid-dispatch
    world.mq.stop_broker()
    time.sleep(6)  # longer than the breaker's open period: sends fail, retries back off
    world.mq.start_broker()
    want = set(bodies)
    ok = wait_for(lambda: want <= {m.body for m, _ in world.inbox.on(world.targets[1])}, 180)
    missing = want - {m.body for m, _ in world.inbox.on(world.targets[1])}
    assert ok, f"lost {len(missing)} of 200: {sorted(missing)[:5]}; engine: {world.service.stats()}"
    dups = len([m for m, _ in world.inbox.on(world.targets[1]) if m.body in want]) - len(want)
    st = world.service.stats()
    print(f"broker restart: delivered 200, duplicates {dups}, retries {st['retries']}, send failures "
          f"{st['send_failures']}")


def test_admin_metrics_move_and_mutations_need_the_token(world: World) -> None:
    import json
    import urllib.error
    import urllib.request

    assert world.service.admin is not None
    base = f"http://{world.service.admin.address}"

    def metrics() -> dict[str, float]:
        text = urllib.request.urlopen(base + "/metrics", timeout=5).read().decode()
        return {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
                if line and not line.startswith("#")}

    before = metrics()
    world.send_delayed(world.targets[0], b"metrics-probe", TW_DELAY_MS="100")
    assert wait_for(lambda: metrics()["timewheel_delivered_total"] > before["timewheel_delivered_total"], 30)
    after = metrics()
    assert after['timewheel_lateness_seconds_count'] > before['timewheel_lateness_seconds_count']
    assert after['timewheel_lateness_seconds_bucket{le="+Inf"}'] == after["timewheel_lateness_seconds_count"]
    assert after["timewheel_scheduled_total"] > before["timewheel_scheduled_total"]
    assert after["timewheel_cancels_held"] == 0  # none cancelled: nothing remembered
    assert after["timewheel_serving"] == 1 and "timewheel_ready" in after  # the readiness, and due messages waiting
    assert json.loads(urllib.request.urlopen(base + "/readyz", timeout=5).read())["ready"] is True
    for headers, status in (({}, 401), ({"Authorization": "Bearer wrong"}, 401)):
        req = urllib.request.Request(base + "/cancel?id=x", method="POST", headers=headers)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=5)
        assert err.value.code == status
    ok = urllib.request.Request(base + "/cancel?id=unknown", method="POST", headers={"Authorization": "Bearer s3cret"})
    assert json.loads(urllib.request.urlopen(ok, timeout=5).read()) == {"cancelled": 0, "applied_on": "engine",
                                                                         "promise": True}
