"""Where is my message, through the real local RocketMQ: messages delivered, cancelled by id and by
key, dead-lettered, retried then delivered and still pending are each found by id and by key with
the right timeline, by `timewheel find` beside the running engine and by `GET /messages`, and the
broker message id `find` shows fetches the delivered copy with `mqadmin queryMsgById`."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from forwarder._rmq_native import NativeProducer
from forwarder.config import RocketMQConfig
from forwarder.local_rocketmq import LocalRocketMQ
from forwarder.rocketmq import OutgoingMessage
from forwarder.rocketmq.admin import create_topics
from timewheel.app.cli import app
from timewheel.app.service import Service
from timewheel.app.settings import AdminConfig, Settings
from timewheel.config import EngineConfig
from tests.polling import wait_for

pytestmark = pytest.mark.rocketmq
TOKEN = "s3cret"
READ_ONLY = 4  # PermName.PERM_READ: the topic takes no new messages


@dataclass
class World:
    mq: LocalRocketMQ
    service: Service
    producer: NativeProducer
    cfg: RocketMQConfig
    data_dir: Path
    run: str

    def send(self, target: str, name: str, **props: str) -> str:
        """A delay message for `target` under key `key-<name>`; the id its producer got back."""
        p = {"TW_TARGET_TOPIC": target, **props}
        return self.producer.send(OutgoingMessage(self.cfg.delay_topic, name.encode(), "t", f"key-{name}-{self.run}",
                                                  p)).msg_id

    def control(self, **props: str) -> None:
        self.producer.send(OutgoingMessage(self.cfg.delay_topic, b"cancel", None, None, props))

    def cli(self, *args: str) -> dict[str, Any]:
        out = CliRunner().invoke(app, ["find", "--data-dir", str(self.data_dir), "--json", *args])
        assert out.exit_code in (0, 1), out.output
        return json.loads(out.stdout)

    def api(self, query: str, token: str | None = TOKEN) -> dict[str, Any]:
        assert self.service.admin is not None
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        req = urllib.request.Request(f"http://{self.service.admin.address}/messages?{query}", headers=headers)
        return json.loads(urllib.request.urlopen(req, timeout=10).read())


@pytest.fixture(scope="module")
def world(rocketmq: LocalRocketMQ, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    run = uuid.uuid4().hex[:8]
    cfg = RocketMQConfig(namesrv=rocketmq.namesrv_addr, delay_topic=f"TW_DELAY_{run}", dead_letter_topic=f"TW_DLQ_{run}",
                         consumer_group=f"tw_ingest_{run}", producer_group=f"tw_delivery_{run}", send_timeout_ms=3000)
    rocketmq.create_topics([cfg.delay_topic, cfg.dead_letter_topic, f"ORDERS_{run}", f"LOCKED_{run}",
                            f"FLAKY_{run}"])
    create_topics(rocketmq.broker_addr, [f"LOCKED_{run}", f"FLAKY_{run}"], perm=READ_ONLY)
    data_dir = tmp_path_factory.mktemp("find")
    settings = Settings(engine=EngineConfig(data_dir, max_delay_ms=24 * 3_600_000, retry_base_ms=1000,
                                            retry_max_ms=4000, max_attempts=6),
                        rocketmq=cfg, admin=AdminConfig(listen="127.0.0.1:0", token=TOKEN))
    service = Service(settings).start()
    producer = NativeProducer(f"tw_find_producer_{run}", rocketmq.namesrv_addr)
    producer.start()
    yield World(rocketmq, service, producer, cfg, data_dir, run)
    producer.shutdown()
    service.stop()


def _states(w: World, ids: dict[str, str]) -> dict[str, str]:
    out = {}
    for name, msg_id in ids.items():
        found = w.api(f"id={msg_id}")["messages"]
        out[name] = found[0]["state"] if found else "not stored yet"
    return out


def _whats(msg: dict[str, Any]) -> list[str]:
    return [s["what"] for s in msg["steps"]]


def test_each_kind_of_message_is_found_by_id_and_key_with_its_timeline(world: World) -> None:
    w, run = world, world.run
    ids = {"delivered": w.send(f"ORDERS_{run}", "delivered", TW_DELAY_MS="500"),
           "by_id": w.send(f"ORDERS_{run}", "by_id", TW_DELAY_MS="600000"),
           "by_key": w.send(f"ORDERS_{run}", "by_key", TW_DELAY_MS="600000"),
           "dead": w.send(f"LOCKED_{run}", "dead", TW_DELAY_MS="0"),
           "retried": w.send(f"FLAKY_{run}", "retried", TW_DELAY_MS="0"),
           "pending": w.send(f"ORDERS_{run}", "pending", TW_DELAY_MS="3600000")}
    assert wait_for(lambda: "not stored yet" not in _states(w, ids).values(), 60), _states(w, ids)
    w.control(TW_CANCEL_ID=ids["by_id"])
    w.control(TW_CANCEL_KEY=f"key-by_key-{run}")
    # the flaky topic takes messages again once the engine has failed to send there
    assert wait_for(lambda: "send_failed" in _whats(w.api(f"id={ids['retried']}")["messages"][0]), 60)
    create_topics(w.mq.broker_addr, [f"FLAKY_{run}"])
    want = {"delivered": "delivered", "by_id": "cancelled", "by_key": "cancelled", "dead": "dead_lettered",
            "retried": "delivered", "pending": "pending"}
    assert wait_for(lambda: _states(w, ids) == want, 120, interval=0.5), _states(w, ids)

    for name, msg_id in ids.items():
        by_cli = [w.cli("--id", msg_id), w.cli("--key", f"key-{name}-{run}")]
        by_api = [w.api(f"id={msg_id}"), w.api(f"key=key-{name}-{run}")]
        for found in by_cli + by_api:
            assert found["count"] == 1, (name, found)
            m = found["messages"][0]
            assert m["msg_id"].startswith(msg_id + ":") and m["state"] == want[name], (name, m)
            assert m["body_bytes"] == len(name) and m["keys"] == [f"key-{name}-{run}"] and m["tags"] == "t"
            steps = _whats(m)
            assert steps[0] == "stored"
            if name == "delivered":
                assert steps == ["stored", "delivered"] and m["topic"] == f"ORDERS_{run}"
            elif name in ("by_id", "by_key"):
                assert steps == ["stored", "cancel_received", "cancelled"]
                assert m["steps"][1]["by"] == name[3:]
            elif name == "dead":
                assert steps == ["stored"] + ["send_failed"] * 5 + ["dead_lettered"]
                assert "writable queue" in m["steps"][1]["error"], m["steps"][1]
                assert m["steps"][-1]["reason"].startswith("not delivered after 6 attempts")
            elif name == "retried":
                assert steps[-1] == "delivered" and set(steps[1:-1]) == {"send_failed"} and len(steps) >= 3
                assert m["steps"][-1]["attempt"] == len(steps) - 1
            else:
                assert steps == ["stored", "pending"] and "waits for its due time" in m["steps"][-1]["note"]

    # the delivered copy, fetched from the broker by the id `find` shows
    for name in ("delivered", "retried"):
        delivered = w.api(f"id={ids[name]}")["messages"][0]["steps"][-1]
        topic = f"ORDERS_{run}" if name == "delivered" else f"FLAKY_{run}"
        out = w.mq.mqadmin("queryMsgById", "-t", topic, "-i", delivered["broker_msg_id"])
        assert f"Topic:               {topic}" in out or topic in out, out
        assert ids[name] in out  # TW_ORIGINAL_MSG_ID carries the producer's id
        assert f"Queue Offset:        {delivered['queue_offset']}" in out, out


def test_the_look_up_needs_the_token_and_bounds_its_answer(world: World) -> None:
    for token, status in ((None, 401), ("wrong", 401)):
        with pytest.raises(urllib.error.HTTPError) as err:
            world.api("key=anything", token)
        assert err.value.code == status
    for query in ("key=a&id=b", "id=", "key=a&limit=0", "key=a&limit=1001", "key=a&limit=x"):
        with pytest.raises(urllib.error.HTTPError) as err:
            world.api(query)
        assert err.value.code == 400, query
    assert world.api(f"key=nobody-{world.run}") == {"query": {"key": f"nobody-{world.run}"}, "count": 0,
                                                     "truncated": False, "messages": [], "cancels": []}
