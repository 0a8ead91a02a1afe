"""RocketMQ's own admin tool (`mqadmin`, from the broker's jars) on the engine's consumer group.

An operator reads the engine's group with `consumerProgress`, `consumerConnection` and
`consumerStatus` (the last two are answered by the engine itself, through the broker), and moves it
back in time with `resetOffsetByTime` while the engine runs: the queues are read again from there,
every message read again is counted as a duplicate, and none is delivered twice.
"""
from __future__ import annotations

import re
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from forwarder.config import RocketMQConfig
from forwarder.local_rocketmq import LocalRocketMQ
from forwarder.rocketmq import OutgoingMessage, ReceivedMessage, RemotingProducer, RemotingPullConsumer
from timewheel.app.service import Service
from timewheel.app.settings import AdminConfig, Settings
from timewheel.config import EngineConfig
from tests.polling import wait_for

pytestmark = pytest.mark.rocketmq


@dataclass
class Engine:
    mq: LocalRocketMQ
    cfg: RocketMQConfig
    service: Service
    target: str

    def send(self, n: int, delay_ms: int, tag: str) -> list[str]:
        """Send `n` delay messages through the wire producer; their ids."""
        producer = RemotingProducer(self.cfg.namesrv, f"admin_test_producer_{uuid.uuid4().hex[:6]}")
        try:
            msgs = [OutgoingMessage(self.cfg.delay_topic, f"{tag}-{i}".encode(), tag, f"k-{tag}-{i}",
                                    {"TW_TARGET_TOPIC": self.target, "TW_DELAY_MS": str(delay_ms)})
                    for i in range(n)]
            ids: list[str] = []
            for m in msgs:  # one at a time: spread over the queues as a Java producer would
                ids += [r.msg_id for r in producer.send_batch(self.cfg.delay_topic, [m])]
            return ids
        finally:
            producer.close()

    def stat(self, name: str) -> int:
        return int(self.service.stats()[name])  # type: ignore[call-overload]


def _engine(mq: LocalRocketMQ, tmp: pytest.TempPathFactory) -> tuple[RocketMQConfig, Service, str]:
    run = uuid.uuid4().hex[:8]
    cfg = RocketMQConfig(namesrv=mq.namesrv_addr, delay_topic=f"TW_DELAY_M{run}", dead_letter_topic=f"TW_DLQ_M{run}",
                         consumer_group=f"tw_ingest_m{run}", producer_group=f"tw_delivery_m{run}")
    target = f"ADMIN_TARGET_{run}"
    mq.create_topics([cfg.delay_topic, cfg.dead_letter_topic, target])
    settings = Settings(engine=EngineConfig(tmp.mktemp("mqadmin"), max_delay_ms=3_600_000), rocketmq=cfg,
                        admin=AdminConfig(listen="127.0.0.1:0"))
    return cfg, Service(settings).start(), target


@pytest.fixture
def engine(broker: LocalRocketMQ, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    cfg, service, target = _engine(broker, tmp_path_factory)
    try:
        yield Engine(broker, cfg, service, target)
    finally:
        service.stop()


def _progress_rows(out: str, topic: str) -> list[list[str]]:
    """The rows of `consumerProgress -s true` for `topic`: topic, broker, qid, broker offset,
    consumer offset, client, diff, inflight, last time."""
    return [line.split() for line in out.splitlines() if line.split()[:1] == [topic]]


def _received(mq: LocalRocketMQ, topic: str, settle_s: float, expect: int) -> list[ReceivedMessage]:
    """Everything on `topic`, read by a fresh group from the first offset until nothing more comes."""
    got: list[ReceivedMessage] = []

    def take(batch: list[ReceivedMessage]) -> bool:
        got.extend(batch)
        return True

    reader = RemotingPullConsumer(mq.namesrv_addr, f"admin_reader_{uuid.uuid4().hex[:6]}", topic, take)
    reader.start()
    try:
        wait_for(lambda: len(got) >= expect, timeout=60)
        time.sleep(settle_s)  # anything delivered twice arrives within this
    finally:
        reader.stop()
    return got


def test_consumer_progress_connection_and_status_show_the_engines_group(engine: Engine) -> None:
    e = engine
    e.send(20, 3_000_000, "far")  # due in 50 min: stored, not delivered during the test
    assert wait_for(lambda: e.stat("scheduled") == 20, timeout=60)
    assert wait_for(lambda: e.mq.consumer_lag(e.cfg.consumer_group, e.cfg.delay_topic) == 0, timeout=30)

    out = e.mq.mqadmin("consumerProgress", "-g", e.cfg.consumer_group, "-s", "true")
    rows = _progress_rows(out, e.cfg.delay_topic)
    assert [r[1:3] for r in rows] == [["broker-a", str(q)] for q in range(4)], out
    assert sum(int(r[3]) for r in rows) == 20, out  # broker offsets: every message sent
    assert all(r[3] == r[4] and r[6] == "0" for r in rows), out  # consumer offset = broker offset, diff 0
    # the client column comes from the engine's own answer to GET_CONSUMER_RUNNING_INFO
    assert {r[5] for r in rows} == {socket.gethostname()}, out
    assert re.search(r"^(Consume )?Diff Total: 0$", out, re.M), out  # 4.9 says "Diff Total"

    out = e.mq.mqadmin("consumerConnection", "-g", e.cfg.consumer_group)
    assert re.search(r"\bPYTHON\b", out) and "CLUSTERING" in out and "CONSUME_PASSIVELY" in out, out
    [client_id] = re.findall(rf"({re.escape(socket.gethostname())}@\S+)", out)
    assert e.cfg.delay_topic in out, out

    out = e.mq.mqadmin("consumerStatus", "-g", e.cfg.consumer_group, "-i", client_id)
    assert "#Consumer Subscription#" in out and re.search(rf"Topic: {e.cfg.delay_topic}\s", out), out
    offsets = re.findall(rf"^{e.cfg.delay_topic}\s+broker-a\s+(\d)\s+(\d+)\s*$", out, re.M)
    assert sorted(int(q) for q, _ in offsets) == [0, 1, 2, 3], out
    assert sum(int(o) for _, o in offsets) == 20, out  # the engine's committed offsets


def _reset_by_time_rereads_without_delivering_twice(e: Engine, caplog: pytest.LogCaptureFixture, how: str) -> None:
    first = e.send(12, 500, "early")
    assert wait_for(lambda: e.stat("delivered") == 12, timeout=60), e.service.stats()
    assert wait_for(lambda: e.mq.consumer_lag(e.cfg.consumer_group, e.cfg.delay_topic) == 0, timeout=30)
    assert e.stat("duplicates") == 0

    # back to before the first message, while the engine runs
    out = e.mq.mqadmin("resetOffsetByTime", "-g", e.cfg.consumer_group, "-t", e.cfg.delay_topic, "-s",
                       str(int(time.time() * 1000) - 3_600_000))
    assert sorted(re.findall(r"^broker-a\s+(\d)\s+(\d+)\s*$", out, re.M)) == [(str(q), "0") for q in range(4)], out

    # every message is read again: the engine knows its id and counts it a duplicate
    assert wait_for(lambda: e.stat("duplicates") == 12, timeout=60), e.service.stats()
    assert wait_for(lambda: e.mq.consumer_lag(e.cfg.consumer_group, e.cfg.delay_topic) == 0, timeout=30)
    later = e.send(3, 500, "late")  # and the group goes on past them
    assert wait_for(lambda: e.stat("delivered") == 15, timeout=60), e.service.stats()

    got = _received(e.mq, e.target, settle_s=3.0, expect=15)
    originals = sorted(m.properties.get("TW_ORIGINAL_MSG_ID", "").split(":")[0] for m in got)
    assert len(got) == 15 and originals == sorted(first + later), "a message was delivered twice or lost"
    assert e.stat("scheduled") == 15 and e.stat("duplicates") == 12
    assert any(how in r.getMessage() for r in caplog.records), f"the reset did not come as {how!r}"
    print(f"\nreset: {len(first)} messages read again, {e.stat('duplicates')} counted as duplicates, "
          f"{len(got)} deliveries for {len(first) + len(later)} messages")


def test_reset_offset_by_time_rereads_and_delivers_nothing_twice(engine: Engine,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """A RocketMQ 5 broker keeps the reset (its default) and answers the next pull OFFSET_MOVED; a 4.9
    broker sends RESET_CONSUMER_CLIENT_OFFSET to the engine."""
    caplog.set_level("WARNING", logger="timewheel.pull")
    how = "the broker moved" if engine.mq.version.startswith("5.") else "reset by the broker"
    _reset_by_time_rereads_without_delivering_twice(engine, caplog, how)


@pytest.fixture(scope="module")
def client_side_reset_broker() -> Iterator[LocalRocketMQ]:
    mq = LocalRocketMQ(stop_timeout=3.0, broker_options={"useServerSideResetOffset": False})
    mq.start()
    try:
        yield mq
    finally:
        mq.stop()


@pytest.mark.slow
def test_reset_offset_sent_to_the_client_is_followed(client_side_reset_broker: LocalRocketMQ,
                                                     tmp_path_factory: pytest.TempPathFactory,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A broker that leaves resets to its clients sends RESET_CONSUMER_CLIENT_OFFSET to the engine."""
    caplog.set_level("WARNING", logger="timewheel.pull")
    cfg, service, target = _engine(client_side_reset_broker, tmp_path_factory)
    try:
        _reset_by_time_rereads_without_delivering_twice(Engine(client_side_reset_broker, cfg, service, target),
                                                        caplog, "reset by the broker")
    finally:
        service.stop()
