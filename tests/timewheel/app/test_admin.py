"""The admin endpoint under abuse: idle connections, streamed bodies, hostile JSON, bad lengths."""
from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from forwarder.shaping_rules import parse_rules
from tests.storage._meta_damage import damage_data_blocks, stored
from timewheel.app.admin import AdminServer, parse_json_object
from timewheel.errors import ConfigError

TOKEN = "tok"


class _Target:
    """Stands in for the Service: validates rules as the service does, holds them."""

    def __init__(self) -> None:
        self.rules: dict[str, Any] = {}
        self.cancels: list[tuple[str | None, str | None]] = []
        self.why: list[str] = []

    def ready(self) -> bool:
        return not self.why

    def not_ready_why(self) -> list[str]:
        return self.why

    def cancel(self, msg_id: str | None, key: str | None) -> int:
        self.cancels.append((msg_id, key))
        return 1

    def shaping_rules(self) -> dict[str, Any]:
        return self.rules

    def replace_shaping_rules(self, rules: dict[str, Any]) -> dict[str, Any]:
        parse_rules(rules)  # raises ConfigError, as ShapingControl.replace does
        self.rules = rules
        return rules

    def stats(self) -> dict[str, object]:
        return {"delivered": 1}

    def status(self) -> dict[str, Any]:
        return {}

    def find_messages(self, msg_id: str | None, key: str | None, limit: int) -> dict[str, Any]:
        return {"found": []}


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


@pytest.fixture
def admin() -> Iterator[tuple[AdminServer, _Target]]:
    target = _Target()
    server = AdminServer("127.0.0.1:0", TOKEN, target, CollectorRegistry()).start()
    try:
        yield server, target
    finally:
        server.stop()


def _request(server: AdminServer, method: str, path: str, body: bytes | None = None,
             headers: dict[str, str] | None = None) -> tuple[int, bytes, float]:
    host, port = server.address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    t0 = time.monotonic()
    try:
        conn.request(method, path, body=body, headers={"Authorization": f"Bearer {TOKEN}", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.read(), time.monotonic() - t0
    finally:
        conn.close()


def test_health_answers_under_300_idle_connections_and_a_streamed_64mib_body(
        admin: tuple[AdminServer, _Target]) -> None:
    server, _ = admin
    host, port = server.address.rsplit(":", 1)
    before = _rss()
    idle = [socket.create_connection((host, int(port))) for _ in range(300)]
    streamer = socket.create_connection((host, int(port)))
    streamer.sendall(f"PUT /shaping HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: {64 << 20}\r\n\r\n"
                     .encode())
    try:
        for _ in range(64):
            streamer.sendall(b"{" * (1 << 20))
    except (BrokenPipeError, ConnectionResetError):
        pass  # refused at the head: the server closed the connection instead of reading 64 MiB
    try:
        deadline = time.monotonic() + 10
        while server.http.open_connections < 300 and time.monotonic() < deadline:
            time.sleep(0.05)
        status, body, took = _request(server, "GET", "/healthz")
        assert status == 200 and json.loads(body) == {"status": "ok"}
        print(f"/healthz under 300 idle connections and a streamed 64 MiB body: {took * 1000:.1f} ms")
        assert took < 5.0  # generous: the figure is printed; a wedged port would not answer at all
        assert _rss() - before < 32 << 20
    finally:
        for s in idle + [streamer]:
            s.close()


@pytest.mark.parametrize("length", ["-1", "abc", "1e3", "+5", "99999999999999999999"])
def test_a_bad_content_length_is_refused_before_auth(admin: tuple[AdminServer, _Target], length: str) -> None:
    server, target = admin
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(f"PUT /shaping HTTP/1.1\r\nContent-Length: {length}\r\n\r\n{{}}".encode())
        answer = s.recv(4096)
    assert answer.startswith(b"HTTP/1.1 400") and target.rules == {}


def test_a_body_over_the_limit_is_refused_whole_and_nothing_after_it_is_read_as_a_request(
        admin: tuple[AdminServer, _Target]) -> None:
    server, target = admin
    host, port = server.address.rsplit(":", 1)
    smuggled = b"POST /cancel?id=x HTTP/1.1\r\nAuthorization: Bearer tok\r\nContent-Length: 0\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(f"PUT /shaping HTTP/1.1\r\nContent-Length: {(1 << 20) + 1}\r\n\r\n".encode())
        try:
            s.sendall(b" " * (1 << 20) + smuggled)
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = s.recv(4096)
    assert answer.startswith(b"HTTP/1.1 413")
    time.sleep(0.2)
    assert target.cancels == []


@pytest.mark.parametrize("body,why", [
    (b"[" * 100_000 + b"]" * 100_000, "nests deeper"),
    (b'{"topics": {"T": {"rate": 1' + b"0" * 5000 + b"}}}", "digits"),
    (b'{"topics": {"T": {"rate": 1e-320}}}', "shaping.topics.T.rate"),
    (b'{"global_rate": NaN}', "not a number"),
    (b'{"global_rate": Infinity}', "not a number"),
    (b"[1, 2]", "JSON object"),
    (b"\xff\xfe", "rules refused"),
])
def test_hostile_rule_bodies_get_a_400_not_a_traceback(admin: tuple[AdminServer, _Target], body: bytes,
                                                        why: str) -> None:
    server, target = admin
    status, answer, _ = _request(server, "PUT", "/shaping", body)
    assert status == 400, answer
    assert why in json.loads(answer)["error"]
    assert target.rules == {}


_json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
                            lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10),
                                                                                               children, max_size=4),
                            max_leaves=20)


@given(st.one_of(st.binary(max_size=300), _json_values.map(lambda v: json.dumps(v).encode()),
                 st.dictionaries(st.sampled_from(["global_rate", "global_burst", "topics", "classes", "backoff"]),
                                 _json_values, max_size=3).map(lambda v: json.dumps(v).encode())))
@settings(max_examples=300, deadline=500)
def test_any_rule_body_parses_to_rules_or_a_named_refusal(body: bytes) -> None:
    try:
        parse_rules(parse_json_object(body))
    except (ValueError, ConfigError):
        pass


def test_cancel_needs_exactly_one_non_empty_selector(admin: tuple[AdminServer, _Target]) -> None:
    server, target = admin
    for path in ("/cancel", "/cancel?id=", "/cancel?id=a&key=b", "/cancel?id=a&id=b"):
        assert _request(server, "POST", path)[0] == 400
    assert _request(server, "POST", "/cancel?key=order-1")[0] == 200
    assert target.cancels == [(None, "order-1")]
    assert _request(server, "GET", "/cancel?id=x")[0] == 405


def test_a_cancel_that_did_not_reach_every_queue_answers_503(admin: tuple[AdminServer, _Target]) -> None:
    from timewheel.app.cancel import CancelNotSentError

    server, target = admin

    def fails(msg_id: str | None, key: str | None) -> int:
        raise CancelNotSentError("the cancel reached 3 of 4 queues of TW_DELAY; send it again")

    target.cancel = fails  # type: ignore[method-assign]
    status, body = _request(server, "POST", "/cancel?id=x")[:2]
    assert status == 503 and b"3 of 4 queues" in body


def test_a_cancel_the_disk_refused_answers_503_with_what_to_do(admin: tuple[AdminServer, _Target]) -> None:
    """A full disk refused the cancel's record: not applied whole, so the caller is to ask again
    (503 with the store's words), not told of an internal error."""
    from storage import StorageWriteError

    server, target = admin

    def fails(msg_id: str | None, key: str | None) -> int:
        raise StorageWriteError("could not record 1 dispatch entries: No space left on device "
                                "(free disk space, then retry)")

    target.cancel = fails  # type: ignore[method-assign]
    status, body = _request(server, "POST", "/cancel?id=x")[:2]
    assert status == 503 and b"No space left on device" in body and b"retry" in body


def test_a_cancel_that_met_a_corrupt_meta_store_answers_503_with_what_to_do(
        admin: tuple[AdminServer, _Target], tmp_path: Path) -> None:
    """The cancel read a damaged block of the meta store: the caller is told so in the store's own words
    (which file, what to do), as for a disk that refused the record, not of an internal error."""
    from storage import MetaStore, MetaStoreCorruptError

    server, target = admin
    d = stored(tmp_path)
    damaged = damage_data_blocks(d)

    def fails(msg_id: str | None, key: str | None) -> int:
        meta = MetaStore(d / "meta", read_only=True)
        try:
            return int(meta.cancelled_at(msg_id or "") is not None)  # what a cancel reads of a stored message
        finally:
            meta.close()

    target.cancel = fails  # type: ignore[method-assign]
    status, body = _request(server, "POST", "/cancel?id=m0")[:2]
    error = json.loads(body)["error"]
    with pytest.raises(MetaStoreCorruptError) as raised:
        fails("m0", None)
    assert (status, error) == (503, str(raised.value)), body
    assert "corrupt" in error and any(str(t) in error for t in damaged) and "move" in error, error


def test_a_look_up_that_met_a_corrupt_meta_store_answers_503_with_what_to_do(
        admin: tuple[AdminServer, _Target], tmp_path: Path) -> None:
    """`GET /messages` read a damaged block of the meta store: the caller is told so in the store's own
    words (which file, what to do), as a cancel is, not of an internal error."""
    from storage import MetaStoreCorruptError
    from timewheel.find import MessageFinder

    server, target = admin
    d = stored(tmp_path)
    damaged = damage_data_blocks(d)

    def finds(msg_id: str | None, key: str | None, limit: int) -> dict[str, Any]:
        with MessageFinder.beside_engine(d) as finder:  # what the service's look-up reads
            return finder.by_key(key or "", 0, limit).to_dict()

    target.find_messages = finds  # type: ignore[method-assign]
    status, body = _request(server, "GET", "/messages?key=k")[:2]
    error = json.loads(body)["error"]
    with pytest.raises(MetaStoreCorruptError) as raised:
        finds(None, "k", 20)
    assert (status, error) == (503, str(raised.value)), body
    assert "corrupt" in error and any(str(t) in error for t in damaged) and "move" in error, error


def test_a_look_up_the_storage_refused_answers_503_with_its_words(admin: tuple[AdminServer, _Target]) -> None:
    """Any storage failure of a look-up (a meta store that could not be opened again) is this engine's
    storage failing: 503 and its words, so the caller knows to ask again or look at the engine."""
    from storage import StorageError

    server, target = admin

    def refuses(msg_id: str | None, key: str | None, limit: int) -> dict[str, Any]:
        raise StorageError("cannot open the meta store: the disk is gone")

    target.find_messages = refuses  # type: ignore[method-assign]
    status, body = _request(server, "GET", "/messages?id=m0")[:2]
    assert (status, json.loads(body)) == (503, {"error": "cannot open the meta store: the disk is gone"}), body


def test_status_is_computed_once_for_many_callers(admin: tuple[AdminServer, _Target],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    server, target = admin
    calls: list[int] = []

    def status() -> dict[str, Any]:
        calls.append(1)
        return {"n": len(calls)}

    monkeypatch.setattr(target, "status", status)
    monkeypatch.setattr("timewheel.app.admin.STATUS_CACHE_S", 3600.0)
    answers = [_request(server, "GET", "/status")[:2] for _ in range(20)]
    assert all(a == (200, b'{"n": 1}\n') for a in answers) and len(calls) == 1


def test_readyz_says_why_it_is_not_ready(admin: tuple[AdminServer, _Target]) -> None:
    """A 503 said `{"ready": false}` and nothing more: the operator had to find the reason in the log."""
    server, target = admin
    status, body, _ = _request(server, "GET", "/readyz")
    assert status == 200 and json.loads(body) == {"ready": True, "why": []}
    target.why = ["checkpoints fail: OSError: [Errno 28] No space left on device (retried every checkpoint_seconds)"]
    status, body, _ = _request(server, "GET", "/readyz", headers={"Authorization": ""})  # no token needed
    assert status == 503 and json.loads(body) == {"ready": False, "why": target.why}
