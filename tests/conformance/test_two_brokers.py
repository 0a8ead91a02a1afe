"""Two brokers on one NameServer: the engine consumes and delivers across both; one broker is
killed mid-run (SIGKILL, as a crash) and started again. Nothing acknowledged is lost, the other
broker's queues keep flowing, and sends fail over to the live broker. The figures are printed (run
with -s to see them)."""
from __future__ import annotations

import collections
import threading
import time
import uuid
from collections.abc import Iterator

import pytest

from forwarder.config import RocketMQConfig
from forwarder.local_rocketmq import LocalRocketMQ
from forwarder.rocketmq import OutgoingMessage, ReceivedMessage, RemotingError, RemotingProducer, RemotingPullConsumer
from timewheel.app.service import Service
from timewheel.app.settings import AdminConfig, Settings
from timewheel.config import EngineConfig
from tests.polling import wait_for

pytestmark = [pytest.mark.rocketmq, pytest.mark.slow]

DELAY_MS = 2000


@pytest.fixture(scope="module")
def two_brokers() -> Iterator[LocalRocketMQ]:
    mq = LocalRocketMQ(stop_timeout=3.0, brokers=2)
    mq.start()
    try:
        yield mq
    finally:
        mq.stop()


class Feeder(threading.Thread):
    """Sends delay messages in small batches until stopped; remembers which were acknowledged, and where."""

    def __init__(self, cfg: RocketMQConfig, target: str) -> None:
        super().__init__(daemon=True)
        self.cfg, self.target = cfg, target
        self.stop = threading.Event()
        self.acked: dict[bytes, tuple[str, float]] = {}  # body -> (broker, monotonic time)
        self.failures = 0

    def run(self) -> None:
        producer = RemotingProducer(self.cfg.namesrv, f"two_feeder_{uuid.uuid4().hex[:6]}", broker_backoff_s=0.5)
        n = 0
        todo: list[OutgoingMessage] = []
        try:
            while not self.stop.is_set():
                while len(todo) < 5:
                    todo.append(OutgoingMessage(self.cfg.delay_topic, f"m-{n}".encode(), "two", None,
                                                {"TW_TARGET_TOPIC": self.target, "TW_DELAY_MS": str(DELAY_MS)}))
                    n += 1
                for m, r in zip(todo, producer.send(todo)):
                    if isinstance(r, RemotingError):
                        self.failures += 1
                    else:
                        self.acked[m.body] = (r.broker, time.monotonic())
                todo = [m for m in todo if m.body not in self.acked]  # failed ones go again
                time.sleep(0.05)
        finally:
            producer.close()


def test_a_broker_stopped_mid_run_loses_nothing_and_the_other_keeps_flowing(
        two_brokers: LocalRocketMQ, tmp_path_factory: pytest.TempPathFactory) -> None:
    mq = two_brokers
    run = uuid.uuid4().hex[:8]
    cfg = RocketMQConfig(namesrv=mq.namesrv_addr, delay_topic=f"TW_DELAY_2B{run}", dead_letter_topic=f"TW_DLQ_2B{run}",
                         consumer_group=f"tw_ingest_2b{run}", producer_group=f"tw_delivery_2b{run}")
    target = f"TWO_TARGET_{run}"
    mq.create_topics([cfg.delay_topic, cfg.dead_letter_topic, target])
    service = Service(Settings(engine=EngineConfig(tmp_path_factory.mktemp("two"), max_delay_ms=3_600_000),
                               rocketmq=cfg, admin=AdminConfig(listen="127.0.0.1:0"))).start()
    delivered: collections.Counter[bytes] = collections.Counter()  # body -> distinct copies the engine sent
    seen: set[str] = set()  # ids of the copies read (a copy read twice is the reader's re-read, not a resend)
    reads = 0
    arrivals: list[float] = []  # monotonic time of each delivery read
    lock = threading.Lock()

    def on_batch(batch: list[ReceivedMessage]) -> bool:
        nonlocal reads
        now = time.monotonic()
        with lock:
            for m in batch:
                reads += 1
                if m.msg_id not in seen:
                    seen.add(m.msg_id)
                    delivered[m.body] += 1
                arrivals.append(now)
        return True

    reader = RemotingPullConsumer(mq.namesrv_addr, f"two_reader_{run}", target, on_batch)
    reader.start()
    feeder = Feeder(cfg, target)
    try:
        feeder.start()
        time.sleep(8)
        down_at = time.monotonic()
        mq.stop_broker(index=1, kill=True)  # broker-b crashes (SIGKILL): no goodbye to clients or NameServer
        stopped = time.monotonic()
        time.sleep(10)
        up_from = time.monotonic()
        mq.start_broker(index=1)
        up_at = time.monotonic()
        time.sleep(8)
        feeder.stop.set()
        feeder.join()
        acked = dict(feeder.acked)
        assert wait_for(lambda: all(delivered[b] for b in acked), timeout=120), \
            f"{sum(1 for b in acked if not delivered[b])} of {len(acked)} acknowledged messages never delivered"
        delivery = service.stats()["delivery"]
    finally:
        feeder.stop.set()
        reader.stop()
        service.stop()

    by_broker = collections.Counter(broker for broker, _ in acked.values())
    sent_while_down = [b for b, (broker, t) in acked.items() if stopped <= t <= up_from]
    outage_deliveries = sum(1 for t in arrivals if stopped <= t <= up_from)
    outage_s = up_from - stopped
    duplicates = sum(c - 1 for c in delivered.values() if c > 1)
    print(f"\ntwo brokers: {len(acked)} acknowledged ({dict(by_broker)}), {feeder.failures} sends failed and "
          f"were sent again; broker-b killed (gone from the NameServer in {stopped - down_at:.1f} s), down "
          f"{outage_s:.1f} s, back in {up_at - up_from:.1f} s; while it was down {len(sent_while_down)} messages "
          f"were acknowledged (all by broker-a: {all(acked[b][0] == 'broker-a' for b in sent_while_down)}) and "
          f"{outage_deliveries} deliveries arrived ({outage_deliveries / outage_s:.0f}/s); every acknowledged "
          f"message delivered, {duplicates} sent twice by the engine ({reads - len(seen)} copies read twice by "
          f"the test's reader: its offsets on the killed broker rolled back); the engine's delivery counters: "
          f"{delivery}")
    assert sent_while_down and all(acked[b][0] == "broker-a" for b in sent_while_down)
    assert outage_deliveries > 0, "the live broker's queues stopped flowing while the other was down"
    assert by_broker["broker-b"] > 0 and by_broker["broker-a"] > 0
