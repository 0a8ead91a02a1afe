"""`RemotingProducer.send_to_every_queue`: one copy on each writable queue (control messages every
consumer of a topic must see), against the scripted NameServer and broker."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from forwarder.rocketmq import BrokerBusyError, OutgoingMessage, Receipt, RemotingProducer, TopicNotFoundError
from tests.forwarder.rocketmq.test_producer import FakeServer, Reply, Request, decode_batch


@pytest.fixture
def server() -> Iterator[FakeServer]:
    s = FakeServer(routes={"T": 4})
    yield s
    s.close()


def test_one_copy_goes_to_each_queue(server: FakeServer) -> None:
    with RemotingProducer(server.addr, "g") as p:
        results = p.send_to_every_queue(OutgoingMessage("T", b"c", "TW_CONTROL", None, {"TW_CANCEL_KEY": "k"}))
    assert all(isinstance(r, Receipt) for r in results)
    assert sorted(int(r.ext["e"]) for r in server.batches()) == [0, 1, 2, 3]
    assert [r.queue_id for r in results] == [0, 1, 2, 3]  # type: ignore[union-attr]
    for req in server.batches():
        [(body, props)] = decode_batch(req.body)
        assert body == b"c" and props["TW_CANCEL_KEY"] == "k" and props["TAGS"] == "TW_CONTROL"
    assert len({r.msg_id for r in results}) == 4  # type: ignore[union-attr]


def test_a_queue_that_refuses_fails_only_its_copy(server: FakeServer) -> None:
    def busy_2(reqs: list[Request]) -> list[tuple[Request, Reply]]:
        return [(r, (2, {}, b"") if r.ext["e"] == "2" else (0, {"queueId": r.ext["e"], "queueOffset": "0"}, b""))
                for r in reqs]

    server.on_batch = busy_2
    with RemotingProducer(server.addr, "g") as p:
        results = p.send_to_every_queue(OutgoingMessage("T", b"c"))
    assert [type(r) for r in results] == [Receipt, Receipt, BrokerBusyError, Receipt]


def test_a_topic_without_a_route_of_its_own_is_refused(server: FakeServer) -> None:
    with RemotingProducer(server.addr, "g") as p, pytest.raises(TopicNotFoundError):
        p.send_to_every_queue(OutgoingMessage("NOPE", b"c"))
