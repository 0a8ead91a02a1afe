"""Where an admin-API cancel was applied: a standby says it cannot promise, the lease holder says it can;
an engine that is not running applies nothing and says so (503), for cancels and traffic rules alike."""
from __future__ import annotations

import http.client
import json
import threading
from pathlib import Path
from typing import Callable, Sequence

from prometheus_client import CollectorRegistry

from coordination import HAConfig
from timewheel.app.admin import AdminServer
from timewheel.app.service import Service
from timewheel.app.settings import Settings
from timewheel.cancels import CancelRequest
from timewheel.config import EngineConfig

TOKEN = "tok"


class _Engine:
    def __init__(self) -> None:
        self.requests: list[CancelRequest] = []

    def apply_cancels(self, requests: Sequence[CancelRequest]) -> int:
        self.requests.extend(requests)
        return 1


class _Endpoints:
    def __init__(self) -> None:
        self.sent: list[tuple[str | None, str | None]] = []

    def send_cancel(self, msg_id: str | None, key: str | None) -> None:
        self.sent.append((msg_id, key))


class _Replica:
    def __init__(self, epoch: int) -> None:
        self.epoch = epoch


def _post(server: AdminServer, path: str, method: str = "POST", body: bytes = b"") -> tuple[int, dict[str, object]]:
    host, port = server.address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request(method, path, body=body, headers={"Authorization": f"Bearer {TOKEN}"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def _service(tmp_path: Path, replica: _Replica | None, ha: bool) -> Service:
    settings = Settings(engine=EngineConfig(tmp_path), ha=HAConfig(zookeeper="127.0.0.1:2181", replica_id="r0")
                        if ha else HAConfig())
    service = Service(settings, admin=False)
    service.engine, service._endpoints, service.replica = _Engine(), _Endpoints(), replica  # type: ignore[assignment]
    return service


def test_a_standby_answers_that_it_cannot_promise_and_the_holder_that_it_can(tmp_path: Path) -> None:
    answers = {}
    # "no lease": a replica without its lease object sends nothing, so it promises nothing
    for role, replica, ha in (("standby", _Replica(0), True), ("holder", _Replica(7), True),
                              ("no lease", None, True), ("engine", None, False)):
        service = _service(tmp_path / role, replica, ha)
        server = AdminServer("127.0.0.1:0", TOKEN, service, CollectorRegistry()).start()
        try:
            answers[role] = _post(server, "/cancel?id=m1")
        finally:
            server.stop()
        assert service._endpoints.sent == [("m1", None)]  # type: ignore[union-attr]  # on the delay topic
    status, standby = answers["standby"]
    assert status == 200 and standby["applied_on"] == "standby" and standby["promise"] is False
    assert "TW_CANCEL_ID" in str(standby["note"]) and "holder" in str(standby["note"])
    assert answers["holder"] == (200, {"cancelled": 1, "applied_on": "holder", "promise": True})
    assert answers["no lease"][1]["applied_on"] == "standby" and answers["no lease"][1]["promise"] is False
    assert answers["engine"] == (200, {"cancelled": 1, "applied_on": "engine", "promise": True})


def test_an_engine_starting_or_stopping_refuses_a_cancel_rather_than_answering_that_it_found_nothing(
        tmp_path: Path) -> None:
    # The admin API answers from before the engine starts until after it stopped: a cancel asked then
    # is neither applied nor on the delay topic, and a 200 ("cancelled": 0) would have the client drop it.
    for phase, (engine, endpoints) in {"before start": (None, None), "engine stopped": (None, _Endpoints()),
                                       "endpoints closed": (_Engine(), None)}.items():
        service = Service(Settings(engine=EngineConfig(tmp_path / phase)), admin=False)
        service.engine, service._endpoints = engine, endpoints  # type: ignore[assignment]
        server = AdminServer("127.0.0.1:0", TOKEN, service, CollectorRegistry()).start()
        try:
            status, answer = _post(server, "/cancel?id=m1")
        finally:
            server.stop()
        assert status == 503, (phase, answer)
        assert "not running" in str(answer["error"]) and "send it again" in str(answer["error"])
        assert engine is None or engine.requests == []
        assert endpoints is None or endpoints.sent == []


def test_an_engine_not_running_refuses_new_traffic_rules_as_unavailable_not_as_invalid(tmp_path: Path) -> None:
    service = Service(Settings(engine=EngineConfig(tmp_path)), admin=False)
    server = AdminServer("127.0.0.1:0", TOKEN, service, CollectorRegistry()).start()
    try:
        status, answer = _post(server, "/shaping", "PUT", b'{"global_rate": 100}')
    finally:
        server.stop()
    assert status == 503 and "not running" in str(answer["error"]), answer


class _Source:
    def stop(self) -> None:
        pass


class _ClosingEndpoints(_Endpoints):
    source = _Source()

    def close(self) -> None:
        pass


class _SlowEngine(_Engine):
    """Its cancel waits for `release`; its stop asks for one more cancel through the admin API."""

    def __init__(self, ask: Callable[[], tuple[int, dict[str, object]]]) -> None:
        super().__init__()
        self.ask, self.release, self.applying = ask, threading.Event(), threading.Event()
        self.stop_answer: tuple[int, dict[str, object]] | None = None

    def apply_cancels(self, requests: Sequence[CancelRequest]) -> int:
        self.applying.set()
        assert self.release.wait(10)
        return super().apply_cancels(requests)

    def stop(self) -> None:
        self.stop_answer = self.ask()


def test_a_stop_waits_for_the_cancel_under_way_and_refuses_the_next_one(tmp_path: Path) -> None:
    service = Service(Settings(engine=EngineConfig(tmp_path)), admin=False)
    server = AdminServer("127.0.0.1:0", TOKEN, service, CollectorRegistry()).start()
    engine = _SlowEngine(lambda: _post(server, "/cancel?id=late"))
    service.engine, service._endpoints = engine, _ClosingEndpoints()  # type: ignore[assignment]
    first: list[tuple[int, dict[str, object]]] = []
    try:
        asking = threading.Thread(target=lambda: first.append(_post(server, "/cancel?id=early")))
        asking.start()
        assert engine.applying.wait(10)
        stopping = threading.Thread(target=service.stop)
        stopping.start()
        stopping.join(0.5)
        assert stopping.is_alive() and engine.stop_answer is None  # the engine is not stopped under the cancel
        engine.release.set()
        asking.join(10)
        stopping.join(10)
    finally:
        engine.release.set()
        server.stop()
    assert first and first[0][0] == 200 and first[0][1]["cancelled"] == 1
    assert engine.stop_answer is not None and engine.stop_answer[0] == 503, engine.stop_answer
    assert [r.msg_id for r in engine.requests] == ["early"]
