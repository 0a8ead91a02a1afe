"""A connection's deadlines: an answer is awaited until the caller's deadline, whatever timeout
the connection was opened with (a long poll waits longer, a short request gives up sooner)."""
from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from forwarder.rocketmq import Connection
from forwarder.rocketmq.errors import RequestTimeoutError
from forwarder.rocketmq.protocol import SUCCESS, decode_request, encode_response, take_frame


class SlowPeer:
    """Answers each request `delay_s` after it came (never, with None), on loopback."""

    def __init__(self, delay_s: float | None) -> None:
        self.delay_s = delay_s
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.addr = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self._listener.settimeout(0.1)
        while not self._stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            with sock:
                buf = bytearray()
                sock.settimeout(0.1)
                while not self._stop.is_set():
                    try:
                        chunk = sock.recv(65536)
                    except TimeoutError:
                        continue
                    if not chunk:
                        break
                    buf += chunk
                    while (frame := take_frame(buf, "client")) is not None:
                        req = decode_request(frame, "client")
                        assert req is not None
                        if self.delay_s is not None:
                            self._stop.wait(self.delay_s)
                            sock.sendall(encode_response(SUCCESS, req.opaque, None, b"answer"))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._listener.close()


@pytest.fixture
def peer(request: pytest.FixtureRequest) -> Iterator[SlowPeer]:
    p = SlowPeer(request.param)
    yield p
    p.close()


@pytest.mark.parametrize("peer", [None], indirect=True)
def test_a_deadline_shorter_than_the_connection_timeout_ends_the_wait(peer: SlowPeer) -> None:
    conn = Connection(peer.addr, timeout=10.0)
    try:
        started = time.monotonic()
        with pytest.raises(RequestTimeoutError):
            conn.request(10, {"a": "b"}, b"", started + 0.3)
        # the deadline, and at most a twentieth of the connection's timeout past it: not its 10 s
        assert 0.3 <= time.monotonic() - started < 3.0
    finally:
        conn.close()


@pytest.mark.parametrize("peer", [0.8], indirect=True)
def test_a_deadline_longer_than_the_connection_timeout_is_waited_for(peer: SlowPeer) -> None:
    conn = Connection(peer.addr, timeout=0.2)
    try:
        answer = conn.request(10, {}, b"", time.monotonic() + 5.0)
        assert (answer.code, answer.body) == (SUCCESS, b"answer")
        # requests one after the other, each with a fresh deadline, on the same socket
        for _ in range(3):
            assert conn.request(10, {}, b"x" * 1000, time.monotonic() + 5.0).body == b"answer"
    finally:
        conn.close()

