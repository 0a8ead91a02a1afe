"""`GET /messages` on the admin endpoint: the token, the selectors and the limit, over a target
that answers from a stand-in (the real look-up is tested against the broker in tests/forwarder)."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from timewheel.app.admin import AdminServer
from timewheel.errors import ConfigError, EngineStateError


class _Finder:
    def __init__(self) -> None:
        self.asked: list[tuple[str | None, str | None, int]] = []
        self.running = True
        self.stopping = False

    def find_messages(self, msg_id: str | None, key: str | None, limit: int) -> dict[str, Any]:
        if self.stopping:
            raise EngineStateError("the service is stopping: look the message up again once it runs")
        if not self.running:
            raise ConfigError("the service is not running: there is no data directory to look in")
        self.asked.append((msg_id, key, limit))
        return {"query": {"id": msg_id} if msg_id else {"key": key}, "count": 0, "truncated": False, "messages": []}


def _get(server: AdminServer, query: str, token: str | None) -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(f"http://{server.address}/messages?{query}", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture
def served() -> Iterator[tuple[AdminServer, _Finder]]:
    target = _Finder()
    server = AdminServer("127.0.0.1:0", "t0ken", target, CollectorRegistry()).start()  # type: ignore[arg-type]
    yield server, target
    server.stop()


def test_a_look_up_needs_the_token_and_one_selector(served: tuple[AdminServer, _Finder]) -> None:
    server, target = served
    assert _get(server, "id=abc", None)[0] == 401
    assert _get(server, "id=abc", "wrong")[0] == 401
    for bad in ("", "id=", "id=a&key=b", "id=a&id=b", "key=k&limit=0", "key=k&limit=1001", "key=k&limit=2&limit=3",
                "key=k&limit=ten", "key=k&limit=%2B5", "key=k&limit=%205", "key=k&limit=1_0",
                "key=k&limit=%EF%BC%95"):  # a sign, a space, a digit separator, a full-width 5: int() takes them
        status, body = _get(server, bad, "t0ken")
        assert status == 400 and body["error"], bad
    assert _get(server, "id=abc", "t0ken") == (200, {"query": {"id": "abc"}, "count": 0, "truncated": False,
                                                     "messages": []})
    assert _get(server, "key=order%2042&limit=1000", "t0ken")[0] == 200
    assert target.asked == [("abc", None, 20), (None, "order 42", 1000)]


def test_without_a_token_configured_look_ups_are_refused(served: tuple[AdminServer, _Finder]) -> None:
    server, target = served
    server.token = ""
    status, body = _get(server, "key=k", "anything")
    assert status == 403 and "message look-ups" in body["error"] and target.asked == []


def test_a_stopped_service_answers_503(served: tuple[AdminServer, _Finder]) -> None:
    server, target = served
    target.running = False
    assert _get(server, "key=k", "t0ken")[0] == 503


def test_a_stopping_service_answers_503_saying_so(served: tuple[AdminServer, _Finder]) -> None:
    server, target = served
    target.stopping = True
    status, body = _get(server, "key=k", "t0ken")
    assert status == 503 and "stopping" in body["error"]
