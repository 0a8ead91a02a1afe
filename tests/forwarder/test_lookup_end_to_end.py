"""Look-ups by UNIQ_KEY on the target topic, through the real local RocketMQ: every copy the engine
delivers carries the id derived from its original id and due time, and is found by it, exactly; a
key never sent is missing even when the index hands back another message under the same hash; a
window that leaves out the send finds nothing; a broker that cannot be reached leaves keys unknown."""
from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pytest

from forwarder.config import RocketMQConfig
from forwarder.contract import DUE_MS, ORIGINAL_MSG_ID, delivered_id
from forwarder.local_rocketmq import LocalRocketMQ
from forwarder.rocketmq import (LookupState, MessageLookup, OutgoingMessage, ReceivedMessage, RemotingProducer,
                                RemotingPullConsumer)
from forwarder.rocketmq.codec import decode_messages
from forwarder.rocketmq.connection import call
from forwarder.rocketmq.protocol import QUERY_MESSAGE, SUCCESS
from timewheel.app.service import Service
from timewheel.app.settings import Settings
from timewheel.config import EngineConfig
from tests.polling import wait_for

pytestmark = pytest.mark.rocketmq
_M32 = (1 << 32) - 1
_HEX = "0123456789ABCDEF"


@dataclass
class World:
    mq: LocalRocketMQ
    cfg: RocketMQConfig
    target: str
    producer: RemotingProducer
    received: list[ReceivedMessage]
    lock: threading.Lock

    def deliver(self, n: int) -> list[ReceivedMessage]:
        """Send `n` delay messages due at once; the copies the engine delivered for them."""
        tag = uuid.uuid4().hex[:8]
        self.producer.send_batch(self.cfg.delay_topic, [
            OutgoingMessage(self.cfg.delay_topic, f"{tag}-{i}".encode(), None, None,
                            {"TW_TARGET_TOPIC": self.target, "TW_DELAY_MS": "0"}) for i in range(n)])

        def mine() -> list[ReceivedMessage]:
            with self.lock:
                return [m for m in self.received if m.body.startswith(tag.encode())]
        assert wait_for(lambda: len(mine()) >= n, 60), f"{len(mine())} of {n} delivered"
        return mine()


@pytest.fixture(scope="module")
def world(rocketmq: LocalRocketMQ, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    run = uuid.uuid4().hex[:8]
    cfg = RocketMQConfig(namesrv=rocketmq.namesrv_addr, delay_topic=f"TW_DELAY_{run}", dead_letter_topic=f"TW_DLQ_{run}",
                         consumer_group=f"tw_ingest_{run}", producer_group=f"tw_delivery_{run}", send_timeout_ms=3000)
    target = f"ORDERS_{run}"
    rocketmq.create_topics([cfg.delay_topic, cfg.dead_letter_topic, target])
    received: list[ReceivedMessage] = []
    lock = threading.Lock()

    def on_batch(batch: Sequence[ReceivedMessage]) -> bool:
        with lock:
            received.extend(batch)
        return True
    consumer = RemotingPullConsumer(rocketmq.namesrv_addr, f"tw_lookup_reader_{run}", target, on_batch)
    consumer.start()
    settings = Settings(engine=EngineConfig(tmp_path_factory.mktemp("lookup"), max_delay_ms=3_600_000), rocketmq=cfg)
    service = Service(settings).start()
    producer = RemotingProducer(rocketmq.namesrv_addr, f"tw_lookup_producer_{run}")
    yield World(rocketmq, cfg, target, producer, received, lock)
    producer.close()
    service.stop()
    consumer.stop()


def window(copies: Sequence[ReceivedMessage]) -> tuple[int, int]:
    """From 2 s before the first store (index times are whole seconds) to a little after now."""
    return min(m.store_timestamp for m in copies) - 2000, int(time.time() * 1000) + 1000


def test_every_delivered_copy_is_found_by_its_derived_id_exactly(world: World) -> None:
    copies = world.deliver(40)
    for m in copies:
        assert m.msg_id == delivered_id(m.properties[ORIGINAL_MSG_ID], int(m.properties[DUE_MS]))
    begin, end = window(copies)
    with MessageLookup(world.cfg.namesrv) as lookup:
        got = lookup.lookup(world.target, [m.msg_id for m in copies], begin, end)
    for m in copies:
        r = got[m.msg_id]
        assert r.state is LookupState.FOUND, r
        assert [(c.queue_id, c.queue_offset) for c in r.copies] == [(m.queue_id, m.queue_offset)]


def java_hash(s: str) -> int:
    """Java's String.hashCode (ASCII), as an unsigned 32-bit number."""
    h = 0
    for ch in s:
        h = (h * 31 + ord(ch)) & _M32
    return h


def hash_twin(key: str, seed: int = 7) -> str:
    """Another 32-hex-digit key with the same Java hashCode as `key` (so `topic#twin` shares the
    index slot and hash of `topic#key`): a random 24-digit head, and an 8-digit tail found by
    meeting in the middle over its two 4-digit halves."""
    rng = random.Random(seed)
    halves = {java_hash(a + b + c + d): a + b + c + d for a in _HEX for b in _HEX for c in _HEX for d in _HEX}
    p4, p8 = 31 ** 4, pow(31, 8, 1 << 32)
    target = java_hash(key)
    while True:
        head = "".join(rng.choice(_HEX) for _ in range(24))
        need = (target - java_hash(head) * p8) & _M32  # what the tail must add
        for h1, s1 in halves.items():
            s2 = halves.get((need - h1 * p4) & _M32)
            if s2 is not None and head + s1 + s2 != key:
                return head + s1 + s2


def test_a_key_never_sent_is_missing_even_when_the_index_returns_a_message_under_its_hash(world: World) -> None:
    [m] = world.deliver(1)
    twin = hash_twin(m.msg_id)
    assert twin != m.msg_id and java_hash(twin) == java_hash(m.msg_id)
    begin, end = window([m])
    # the index alone answers the twin with the delivered copy ...
    ext = {"topic": world.target, "key": twin, "maxNum": "32", "beginTimestamp": str(begin),
           "endTimestamp": str(end), "_UNIQUE_KEY_QUERY": "true"}
    raw = call(world.mq.broker_addr, QUERY_MESSAGE, ext, b"", 5.0)
    assert raw.code == SUCCESS
    assert m.msg_id in [x.msg_id for x in decode_messages(raw.body)]
    # ... and the look-up, comparing the id itself, says it is not there
    with MessageLookup(world.cfg.namesrv) as lookup:
        got = lookup.lookup(world.target, [twin, m.msg_id], begin, end)
    assert got[twin].state is LookupState.MISSING
    assert got[m.msg_id].state is LookupState.FOUND
    # random keys never sent: missing too
    strangers = ["".join(random.choice(_HEX) for _ in range(32)) for _ in range(200)]
    with MessageLookup(world.cfg.namesrv) as lookup:
        assert {r.state for r in lookup.lookup(world.target, strangers, begin, end).values()} == {LookupState.MISSING}


def test_a_window_that_leaves_out_the_send_finds_nothing(world: World) -> None:
    copies = world.deliver(5)
    first = min(c.store_timestamp for c in copies)
    with MessageLookup(world.cfg.namesrv) as lookup:
        got = lookup.lookup(world.target, [m.msg_id for m in copies], first - 3_600_000, first - 60_000)
    assert {r.state for r in got.values()} == {LookupState.MISSING}


def test_a_broker_that_cannot_be_reached_leaves_keys_unknown_never_missing(world: World) -> None:
    copies = world.deliver(3)
    begin, end = window(copies)
    never = "F" * 32
    with MessageLookup(world.cfg.namesrv, timeout_ms=1000) as lookup:
        real = lookup.brokers(world.target)
        lookup.brokers = lambda topic: {**real, "ghost": "127.0.0.1:1"}  # type: ignore[method-assign]
        got = lookup.lookup(world.target, [never, *(m.msg_id for m in copies)], begin, end)
    assert got[never].state is LookupState.UNKNOWN
    assert "ConnectionFailedError" in got[never].errors[0]
    assert all(got[m.msg_id].state is LookupState.FOUND for m in copies)  # found on the broker that answered
