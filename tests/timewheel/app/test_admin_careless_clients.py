"""The admin endpoint against careless and hostile clients: idle sockets filling every slot, a query
that is not UTF-8, a body shorter than its `Content-Length`, a body sent without the token."""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from tests.polling import wait_for
from tests.timewheel.app.test_admin import TOKEN, _Target
from timewheel.app._http import HttpLimits, HttpServer, Request, Response
from timewheel.app.admin import AdminServer

SLOTS = 8


@pytest.fixture
def crowded_admin() -> Iterator[tuple[AdminServer, _Target]]:
    target = _Target()
    server = AdminServer("127.0.0.1:0", TOKEN, target, CollectorRegistry(),
                         HttpLimits(max_connections=SLOTS, idle_timeout_s=600, read_timeout_s=1.0)).start()
    try:
        yield server, target
    finally:
        server.stop()


def _call(address: str, method: str, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request(method, path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def _closed_by_server(s: socket.socket) -> bool:
    """Whether the server closed `s` (it reads nothing more from it): EOF or a reset, within 10 s."""
    s.settimeout(10)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_readyz_answers_while_idle_connections_hold_every_slot(crowded_admin: tuple[AdminServer, _Target]) -> None:
    """A probe that finds every slot taken by sockets that ask nothing gets its answer, not a 503 that
    would take a healthy engine out of rotation: the longest idle connection makes room."""
    server, _ = crowded_admin
    host, port = server.address.rsplit(":", 1)
    idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(SLOTS)]
    try:
        assert wait_for(lambda: server.http.open_connections == SLOTS, 10)
        status, body = _call(server.address, "GET", "/readyz")
        assert status == 200 and json.loads(body) == {"ready": True, "why": []}
        assert _closed_by_server(idle[0]), "the connection idle the longest was not the one closed"
        assert server.http.open_connections <= SLOTS
    finally:
        for s in idle:
            s.close()


def test_idle_connections_trickling_their_heads_cannot_starve_the_probe(
        crowded_admin: tuple[AdminServer, _Target]) -> None:
    server, _ = crowded_admin
    host, port = server.address.rsplit(":", 1)
    slow = [socket.create_connection((host, int(port)), timeout=10) for _ in range(SLOTS)]
    try:
        for s in slow:
            s.sendall(b"GET /readyz HTTP/1.1\r\nX-Slow: ")  # a head never finished
        assert wait_for(lambda: server.http.open_connections == SLOTS, 10)
        status, _ = _call(server.address, "GET", "/healthz")
        assert status == 200
    finally:
        for s in slow:
            s.close()


def test_connections_whose_request_is_being_answered_are_not_closed_to_make_room() -> None:
    entered = threading.Semaphore(0)
    release = threading.Event()

    def handler(req: Request) -> Response:
        if req.path == "/hold":
            entered.release()
            release.wait(30)
        return Response.json(200, {"path": req.path})

    srv = HttpServer("127.0.0.1", 0, handler, HttpLimits(max_connections=2, handler_threads=2),
                     inline=lambda r: r.path == "/healthz").start()
    answers: list[int] = []
    holders = [threading.Thread(target=lambda: answers.append(_call(srv.address, "GET", "/hold")[0]))
               for _ in range(2)]
    try:
        for t in holders:
            t.start()
        assert entered.acquire(timeout=10) and entered.acquire(timeout=10)
        status, body = _call(srv.address, "GET", "/healthz")
        assert status == 503 and b"too many connections" in body
        release.set()
        for t in holders:
            t.join(30)
        assert answers == [200, 200]
    finally:
        release.set()
        srv.stop()


@pytest.mark.parametrize("query", ["id=%ff", "key=%C3", "id=a%80b"])
def test_a_cancel_whose_query_is_not_utf8_is_refused_and_nothing_is_cancelled(
        crowded_admin: tuple[AdminServer, _Target], query: str) -> None:
    """Decoding would turn the bytes into U+FFFD and cancel some other id; the caller is told instead."""
    server, target = crowded_admin
    status, body = _call(server.address, "POST", f"/cancel?{query}", {"Authorization": f"Bearer {TOKEN}"})
    assert status == 400 and b"UTF-8" in body, body
    assert target.cancels == []


def test_a_body_shorter_than_its_content_length_is_answered_408(crowded_admin: tuple[AdminServer, _Target]) -> None:
    server, target = crowded_admin
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(f"PUT /shaping HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: 10\r\n\r\n{{}}"
                  .encode())
        answer = b""
        while chunk := s.recv(4096):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert b"Content-Length" in answer and target.rules == {}


@pytest.mark.parametrize("scheme", ["bearer", "BEARER"])
def test_the_bearer_scheme_is_matched_whatever_its_case(crowded_admin: tuple[AdminServer, _Target],
                                                         scheme: str) -> None:
    """HTTP's auth schemes are case-insensitive: a client that writes `bearer` was refused 401."""
    server, target = crowded_admin
    status, body = _call(server.address, "POST", "/cancel?id=m1", {"Authorization": f"{scheme} {TOKEN}"})
    assert status == 200, body
    assert target.cancels == [("m1", None)]


def test_a_body_sent_after_100_continue_is_not_held_back(crowded_admin: tuple[AdminServer, _Target]) -> None:
    """curl sends `Expect: 100-continue` before a body over 1 KiB and waits for the interim answer (a
    second, then sends anyway): without it every such `PUT /shaping` waited that second."""
    server, target = crowded_admin
    host, port = server.address.rsplit(":", 1)
    body = json.dumps({"topics": {f"T{i:04d}": {"rate": 100} for i in range(100)}}).encode()  # over 1 KiB
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(f"PUT /shaping HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: {len(body)}\r\n"
                  "Expect: 100-continue\r\n\r\n".encode())
        interim = s.recv(4096)  # before the body is sent: the interim answer, or (without one) the 408
        assert interim.startswith(b"HTTP/1.1 100 Continue\r\n\r\n"), interim
        s.sendall(body)
        final = interim[len(b"HTTP/1.1 100 Continue\r\n\r\n"):]
        while b"\r\n\r\n" not in final:
            final += s.recv(4096)
    assert final.startswith(b"HTTP/1.1 200 "), final
    assert len(target.rules["topics"]) == 100


def _answer_head(s: socket.socket) -> bytes:
    """What the server answers on `s` up to the end of its head (or the connection's end)."""
    answer = b""
    while b"\r\n\r\n" not in answer and (chunk := s.recv(4096)):
        answer += chunk
    return answer


@pytest.mark.parametrize("token", ["", "wrong"])
def test_a_guarded_request_without_the_token_is_refused_before_its_body_is_read(
        crowded_admin: tuple[AdminServer, _Target], token: str) -> None:
    """Its head alone is answered: the server neither waits for nor holds an unauthenticated body (a
    few hundred such clients could otherwise make it hold a MiB each)."""
    server, target = crowded_admin
    host, port = server.address.rsplit(":", 1)
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(f"PUT /shaping HTTP/1.1\r\n{auth}Content-Length: 1000000\r\n\r\n".encode())
        answer = _answer_head(s)  # no body sent: waiting for it would answer 408 after the read timeout
        assert answer.startswith(b"HTTP/1.1 401 "), answer
        assert b"Connection: close" in answer
    assert target.rules == {}


def test_a_client_sending_its_body_after_the_refusal_can_still_send_it_and_read_the_answer(
        crowded_admin: tuple[AdminServer, _Target]) -> None:
    """The body is read away unkept before the close. A client that sends its whole body before reading
    (most do) would otherwise write into a closed connection: a broken pipe instead of the 401."""
    server, target = crowded_admin
    host, port = server.address.rsplit(":", 1)
    body = b"x" * (1 << 20)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(f"POST /cancel?id=m1 HTTP/1.1\r\nContent-Length: {len(body)}\r\n\r\n".encode())
        time.sleep(0.3)  # the server answers meanwhile
        for i in range(0, len(body), 65536):
            s.sendall(body[i:i + 65536])
        answer = _answer_head(s)
        assert answer.startswith(b"HTTP/1.1 401 "), answer
        assert _closed_by_server(s)
    assert target.cancels == []


def test_a_server_without_a_token_refuses_a_guarded_body_with_403() -> None:
    target = _Target()
    server = AdminServer("127.0.0.1:0", "", target, CollectorRegistry(), HttpLimits(read_timeout_s=1.0)).start()
    try:
        host, port = server.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(b"PUT /shaping HTTP/1.1\r\nContent-Length: 500\r\n\r\n")
            answer = _answer_head(s)
        assert answer.startswith(b"HTTP/1.1 403 ") and b"no admin token" in answer, answer
    finally:
        server.stop()
