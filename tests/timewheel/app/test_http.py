"""The admin port's HTTP server: every bound a client controls holds, and health answers through abuse."""
from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.polling import wait_for
from timewheel.app._http import HttpError, HttpLimits, HttpServer, Request, Response, body_length, parse_head

LIMITS = HttpLimits()


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@given(st.binary(max_size=4096))
@settings(max_examples=400, deadline=200)
def test_any_bytes_parse_or_are_refused_with_a_status(head: bytes) -> None:
    try:
        req = parse_head(head, LIMITS)
        body_length(req.headers, LIMITS)
    except HttpError as e:
        assert 400 <= e.status < 600 and e.reason


_TOKEN = st.text(st.characters(min_codepoint=33, max_codepoint=126, exclude_characters=":"), min_size=1, max_size=20)


@given(st.sampled_from(["GET", "PUT", "POST", "BREW"]), st.text(max_size=40),
       st.lists(st.tuples(_TOKEN, st.text(max_size=40)), max_size=80), st.text(max_size=30))
@settings(max_examples=400, deadline=200)
def test_structured_heads_parse_or_are_refused_with_a_status(method: str, path: str, headers: list[tuple[str, str]],
                                                              length: str) -> None:
    lines = [f"{method} /{path} HTTP/1.1", *(f"{k}: {v}" for k, v in headers), f"Content-Length: {length}"]
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("utf-8", "surrogatepass")
    try:
        req = parse_head(head, LIMITS)
        n = body_length(req.headers, LIMITS)
        assert 0 <= n <= LIMITS.max_body_bytes
    except HttpError as e:
        assert 400 <= e.status < 600


@pytest.mark.parametrize("target", ["//[", "//[::1", "//a]"])
def test_a_target_that_reads_as_a_broken_host_is_refused_with_400(target: str) -> None:
    with pytest.raises(HttpError) as e:
        parse_head(f"GET {target} HTTP/1.1\r\nHost: x\r\n\r\n".encode(), LIMITS)
    assert e.value.status == 400


@pytest.mark.parametrize("value,status", [("-1", 400), ("abc", 400), ("+5", 400), (" 5x", 400), ("１２", 400),
                                          ("99999999999999999999", 400), (str(64 << 20), 413), (str(1 << 20), None)])
def test_content_length_must_be_a_byte_count_within_the_limit(value: str, status: int | None) -> None:
    if status is None:
        assert body_length({"content-length": value}, LIMITS) == 1 << 20
        return
    with pytest.raises(HttpError) as e:
        body_length({"content-length": value}, LIMITS)
    assert e.value.status == status


def test_chunked_bodies_are_refused() -> None:
    with pytest.raises(HttpError) as e:
        body_length({"transfer-encoding": "chunked"}, LIMITS)
    assert e.value.status == 411


def test_two_content_lengths_are_refused() -> None:
    with pytest.raises(HttpError) as e:
        parse_head(b"PUT / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 5\r\n\r\n")
    assert e.value.status == 400


@pytest.mark.parametrize("method, methods, status", [("PATCH", None, 501), ("BREW", None, 501),
                                                     ("DELETE", frozenset({"GET", "HEAD"}), 501),
                                                     ("G(T", None, 400), ("DELETE", None, None)])
def test_a_method_the_server_takes_nowhere_is_501_naming_it(method: str, methods: frozenset[str] | None,
                                                           status: int | None) -> None:
    """RFC 9110: 501 for a method not recognised for any resource; a request line whose method is not a
    token is malformed (400), not a method."""
    head = f"{method} /x HTTP/1.1\r\nHost: x\r\n\r\n".encode()
    if status is None:
        assert parse_head(head, LIMITS).method == method
        return
    with pytest.raises(HttpError) as e:
        parse_head(head, LIMITS) if methods is None else parse_head(head, LIMITS, methods)
    assert e.value.status == status
    if status == 501:
        assert f"method {method!r} is not implemented" in e.value.reason
        assert ", ".join(sorted(methods or {"DELETE", "GET", "HEAD", "POST", "PUT"})) in e.value.reason


def _handler(req: Request) -> Response:
    if req.path == "/boom":
        raise RuntimeError("handler bug")
    if req.path == "/slow":
        time.sleep(2)
    return Response.json(200, {"path": req.path, "body": len(req.body)})


@pytest.fixture
def server() -> Iterator[HttpServer]:
    srv = HttpServer("127.0.0.1", 0, _handler, HttpLimits(idle_timeout_s=60, handler_threads=2),
                     inline=lambda r: r.path == "/healthz").start()
    try:
        yield srv
    finally:
        srv.stop()


def _get(address: str, path: str, timeout: float = 10.0) -> tuple[int, bytes, float]:
    host, port = address.rsplit(":", 1)
    t0 = time.monotonic()
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read(), time.monotonic() - t0
    finally:
        conn.close()


def test_health_answers_under_300_idle_connections_and_a_streamed_64mib_body(server: HttpServer) -> None:
    host, port = server.address.rsplit(":", 1)
    rss_before = _rss_bytes()
    idle = [socket.create_connection((host, int(port))) for _ in range(300)]
    half = [socket.create_connection((host, int(port))) for _ in range(20)]
    for s in half:  # a head that never ends
        s.sendall(b"GET /healthz HTTP/1.1\r\nX-Slow: ")
    streamer = socket.create_connection((host, int(port)))
    streamer.sendall(f"PUT /shaping HTTP/1.1\r\nContent-Length: {64 << 20}\r\n\r\n".encode())
    answer = b""
    try:
        chunk = b"x" * (1 << 20)
        for _ in range(64):  # the server refuses at the head and closes: the stream hits a closed socket
            streamer.sendall(chunk)
    except (BrokenPipeError, ConnectionResetError):
        pass
    try:
        streamer.settimeout(5)
        answer = streamer.recv(4096)
    except (ConnectionResetError, TimeoutError, OSError):
        pass
    try:
        deadline = time.monotonic() + 10
        while server.open_connections < 300 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.open_connections >= 300
        status, body, took = _get(server.address, "/healthz")
        assert status == 200 and b'"/healthz"' in body
        # A generous bound: the point is that it answers at all while the port is under load.
        assert took < 5.0, f"/healthz took {took:.2f} s"
        assert _rss_bytes() - rss_before < 32 << 20
        if answer:
            assert answer.startswith(b"HTTP/1.1 413")
    finally:
        for s in idle + half + [streamer]:
            s.close()


def test_a_failing_or_slow_handler_does_not_take_health_down(server: HttpServer) -> None:
    status, body, _ = _get(server.address, "/boom")
    assert status == 500 and b"internal error" in body
    slow = [threading.Thread(target=_get, args=(server.address, "/slow")) for _ in range(4)]
    for t in slow:
        t.start()
    time.sleep(0.2)
    status, _, _ = _get(server.address, "/healthz")
    # health answered while every handler thread was still busy with a slow request
    assert status == 200 and all(t.is_alive() for t in slow)
    for t in slow:
        t.join()


def test_keep_alive_serves_several_requests_on_one_connection(server: HttpServer) -> None:
    host, port = server.address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        for i in range(3):
            conn.request("PUT", f"/x{i}", body=b"abc")
            resp = conn.getresponse()
            assert resp.status == 200 and b'"body": 3' in resp.read()
    finally:
        conn.close()


def _big(req: Request) -> Response:
    return Response(200, b"x" * (4 << 20), "application/octet-stream")


def test_clients_that_never_read_cannot_pin_the_connections() -> None:
    """Two clients pipeline requests for large answers and never read: each connection is dropped once
    its answer has waited `write_timeout_s`, and health answers again."""
    srv = HttpServer("127.0.0.1", 0, lambda r: Response.json(200, {}) if r.path == "/healthz" else _big(r),
                     HttpLimits(max_connections=2, write_timeout_s=0.5, idle_timeout_s=600),
                     inline=lambda r: r.path == "/healthz").start()
    host, port = srv.address.rsplit(":", 1)
    pinned = []
    try:
        for _ in range(2):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect((host, int(port)))
            s.sendall(b"GET /big HTTP/1.1\r\n\r\n" * 50)
            pinned.append(s)
        assert wait_for(lambda: srv.open_connections == 2, 10)

        def healthy() -> bool:
            try:
                return _get(srv.address, "/healthz", timeout=2)[0] == 200
            except OSError:
                return False
        assert wait_for(healthy, 30), f"{srv.open_connections} connections still open"
    finally:
        for s in pinned:
            s.close()
        srv.stop()


_FD_SCRIPT = """
import resource, sys, tempfile
resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
from timewheel.app._http import HttpServer, HttpLimits, Response
srv = HttpServer("127.0.0.1", 0, lambda r: Response.json(200, {}), HttpLimits(idle_timeout_s=600)).start()
print(srv.address, srv.max_connections, flush=True)
sys.stdin.readline()
files = []
try:
    for _ in range(100):
        files.append(tempfile.TemporaryFile())
    print("opened", len(files), srv.open_connections, flush=True)
except OSError as e:
    print("failed", e, srv.open_connections, flush=True)
"""


def test_idle_connections_cannot_exhaust_the_processs_file_descriptors() -> None:
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.Popen([sys.executable, "-c", _FD_SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env={"PATH": "/usr/bin:/bin",
                                            "PYTHONPATH": str(Path(__file__).resolve().parents[3])})
    assert proc.stdin is not None and proc.stdout is not None
    idle = []
    try:
        address, cap = proc.stdout.readline().split()
        assert int(cap) <= 64  # a quarter of the 256 the process may open
        host, port = address.rsplit(":", 1)
        idle = [socket.create_connection((host, int(port))) for _ in range(200)]
        try:
            _get(address, "/x", timeout=10)  # answered or refused once every connection before it was taken
        except OSError:
            pass
        proc.stdin.write("go\n")
        proc.stdin.flush()
        said = proc.stdout.readline()
        assert said.startswith("opened 100"), said
    finally:
        for s in idle:
            s.close()
        proc.kill()
        proc.wait()


def test_the_soft_open_files_limit_is_raised_within_the_hard_one() -> None:
    import subprocess
    import sys
    from pathlib import Path

    script = ("import resource\nresource.setrlimit(resource.RLIMIT_NOFILE, (256, 1024))\n"
              "from timewheel.app._http import raise_open_files_limit\n"
              "print(raise_open_files_limit(), resource.getrlimit(resource.RLIMIT_NOFILE))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[3])})
    assert out.stdout.split() == ["1024", "(1024,", "1024)"]


def _start_in_background(srv: HttpServer) -> tuple[threading.Thread, list[BaseException]]:
    """Call `srv.start()` on a thread of its own, so that a start that never returns cannot hang the tests."""
    raised: list[BaseException] = []

    def start() -> None:
        try:
            srv.start(timeout_s=0.5)
        except BaseException as e:
            raised.append(e)

    starting = threading.Thread(target=start, daemon=True)
    starting.start()
    starting.join(30)
    return starting, raised


def test_a_server_whose_event_loop_cannot_listen_says_why_instead_of_waiting_for_ever(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from timewheel.app._http import HttpStartError

    async def refused(*args: object, **kwargs: object) -> asyncio.AbstractServer:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(asyncio, "start_server", refused)
    srv = HttpServer("127.0.0.1", 0, _handler, name="timewheel-http-test")
    address = srv.address
    starting, raised = _start_in_background(srv)
    try:
        assert not starting.is_alive(), "start() still waits for a server thread that ended"
        assert len(raised) == 1 and isinstance(raised[0], HttpStartError), raised
        assert address in str(raised[0]) and "Too many open files" in str(raised[0])
        assert isinstance(raised[0].__cause__, OSError)
        assert not any(t.name == "timewheel-http-test" for t in threading.enumerate())
        socket.create_server(("127.0.0.1", int(address.rsplit(":", 1)[1]))).close()  # the port was let go
    finally:
        srv.stop()


def test_a_server_that_does_not_come_up_within_the_bound_is_an_error_and_lets_its_port_go(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from timewheel.app._http import HttpStartError

    async def stuck(*args: object, **kwargs: object) -> asyncio.AbstractServer:
        await asyncio.Event().wait()  # never set: the loop never gets to listen
        raise AssertionError("unreachable")

    monkeypatch.setattr(asyncio, "start_server", stuck)
    srv = HttpServer("127.0.0.1", 0, _handler, name="timewheel-http-test")
    address = srv.address
    starting, raised = _start_in_background(srv)
    try:
        assert not starting.is_alive(), "start() still waits for a server that never listens"
        assert len(raised) == 1 and isinstance(raised[0], HttpStartError), raised
        assert address in str(raised[0]) and "0.5 s" in str(raised[0])
        assert not any(t.name == "timewheel-http-test" for t in threading.enumerate())
        socket.create_server(("127.0.0.1", int(address.rsplit(":", 1)[1]))).close()
    finally:
        srv.stop()
