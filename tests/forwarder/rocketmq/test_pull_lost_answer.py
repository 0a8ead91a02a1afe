"""A pull the broker never answers: the connection it was sent on is made again and every queue of
it pulled anew, rather than the queue waiting for ever on a connection that may carry nothing more
(a half-open TCP connection, a woken long poll the broker failed to answer). A long poll answered
late, as a broker's hold service answers one (it looks at held pulls every 5 s), is still awaited."""
from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from forwarder.rocketmq import _puller
from forwarder.rocketmq._puller import Puller, PullSettings
from forwarder.rocketmq._queue_state import QueueTable
from forwarder.rocketmq.protocol import PULL_MESSAGE, SUCCESS, decode_request, encode_response, take_frame
from tests.forwarder.rocketmq.test_codec import stored
from tests.polling import wait_for

Q = ("broker-a", 0)


class PullBroker:
    """Answers PULL_MESSAGE with one stored message at the offset asked for, `delay_s[n]` seconds
    after the pull came on its n-th connection (None: never; past the list: at once)."""

    def __init__(self, delay_s: list[float | None]) -> None:
        self.delay_s = delay_s
        self.connections = 0
        self.pulls: list[tuple[int, int]] = []  # (connection, offset) of every pull
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.addr = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            self._socks.append(sock)
            threading.Thread(target=self._serve, args=(sock, self.connections), daemon=True).start()
            self.connections += 1

    def _serve(self, sock: socket.socket, n: int) -> None:
        delay = self.delay_s[n] if n < len(self.delay_s) else 0.0
        buf = bytearray()
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                buf += chunk
                while (frame := take_frame(buf, "client")) is not None:
                    req = decode_request(frame, "client")
                    assert req is not None and req.code == PULL_MESSAGE
                    offset = int(req.ext["queueOffset"])
                    self.pulls.append((n, offset))
                    if delay is None:
                        continue  # swallowed: no answer ever comes on this connection
                    threading.Timer(delay, self._answer, args=(sock, req.opaque, offset)).start()

    @staticmethod
    def _answer(sock: socket.socket, opaque: int, offset: int) -> None:
        body = stored(f"m{offset}".encode(), "T", {"UNIQ_KEY": f"ID{offset}"}, queue_offset=offset)
        ext = {"nextBeginOffset": str(offset + 1), "minOffset": "0", "maxOffset": str(offset + 1)}
        with contextlib.suppress(OSError):
            sock.sendall(_with_ext(encode_response(SUCCESS, opaque, None, body), ext))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


def _with_ext(frame: bytes, ext: dict[str, str]) -> bytes:
    """A response frame of `encode_response` with extFields added to its header."""
    (length, info) = struct.unpack_from(">ii", frame)
    header = json.loads(frame[8:8 + info])
    header["extFields"] = ext
    raw = json.dumps(header).encode()
    body = frame[8 + info:]
    return struct.pack(">ii", 4 + len(raw) + len(body), len(raw)) + raw + body


@contextlib.contextmanager
def _pulling(broker: PullBroker, got: list[bytes]) -> Iterator[Puller]:
    table = QueueTable()
    table.add(Q, 0)

    def take(batch: list[Any]) -> bool:
        got.extend(m.body for m in batch)
        return True

    # a long poll of 100 ms, requests of 300 ms
    settings = PullSettings("g", "T", 32, 100, 0.05, 0.3, 4 << 20, 3, 64 << 20, None)
    membership = SimpleNamespace(address=lambda name: broker.addr, commit=lambda q, st: None)
    counters = {"batches": 0, "refused": 0, "pulled": 0, "undecodable": 0, "bad_answers": 0, "pull_gaps": 0}
    puller = Puller(settings, table, membership, take, lambda request: None, counters)  # type: ignore[arg-type]
    puller.running.set()
    puller.pull_from(Q[0])
    try:
        yield puller
    finally:
        puller.stop()
        broker.close()


def test_a_pull_never_answered_is_sent_again_on_a_new_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_puller, "_LATE_ANSWER_S", 0.3, raising=False)  # a pull is lost 0.1 + 0.3 + 0.3 s after it went
    broker = PullBroker([None])
    got: list[bytes] = []
    with _pulling(broker, got) as puller:
        assert wait_for(lambda: got[:1] == [b"m0"], timeout=5), (
            f"the queue waits for ever on an answer that never comes: pulls {broker.pulls}, got {got}")
        assert broker.pulls[:2] == [(0, 0), (1, 0)], "the same offset pulled again, on a new connection"
        assert puller.dead_threads() == []


def test_a_long_poll_answered_late_is_awaited_on_its_connection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_puller, "_LATE_ANSWER_S", 1.0, raising=False)
    broker = PullBroker([0.8])  # later than the long poll and the request timeout, within the slack
    got: list[bytes] = []
    with _pulling(broker, got):
        assert wait_for(lambda: len(got) >= 3, timeout=10), got
        assert got[:3] == [b"m0", b"m1", b"m2"] and broker.connections == 1
