"""PULL_RETRY_IMMEDIATELY (20): the broker found nothing readable where it looked (messages it
filtered, or whose commit-log file is being removed) and says where to look next (nextBeginOffset).
The queue moves there, after pulling the same offset again like any answer that skips offsets, and
is never pulled again at once at an offset the broker keeps answering so: a pull thread spinning a
core on one queue, and that queue stalled for good."""
from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

from forwarder.rocketmq import _puller
from forwarder.rocketmq._puller import Puller, PullSettings
from forwarder.rocketmq._queue_state import QueueTable
from forwarder.rocketmq.protocol import (PULL_MESSAGE, PULL_NOT_FOUND, PULL_RETRY_IMMEDIATELY, SUCCESS,
                                         decode_request, encode_response, take_frame)
from tests.forwarder.rocketmq.test_codec import stored
from tests.forwarder.rocketmq.test_pull_lost_answer import _with_ext
from tests.polling import wait_for

Q = ("broker-a", 0)
#: the end of the fake broker's queue
_END = 5

#: how the fake broker answers a pull at an offset: (code, nextBeginOffset)
Rule = Callable[[int], tuple[int, int]]


class RetryBroker:
    """Answers PULL_MESSAGE as `rule` says for the offset asked: SUCCESS with the one stored message
    there, PULL_NOT_FOUND after the long poll, anything else at once with no body."""

    def __init__(self, rule: Rule, suspend_s: float) -> None:
        self.rule = rule
        self.suspend_s = suspend_s
        self.pulls: list[int] = []  # the offset of every pull
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
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        buf = bytearray()
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                buf += chunk
                while (frame := take_frame(buf, "client")) is not None:
                    req = decode_request(frame, "client")
                    assert req is not None and req.code == PULL_MESSAGE
                    offset = int(req.ext["queueOffset"])
                    self.pulls.append(offset)
                    code, nxt = self.rule(offset)
                    body = (stored(f"m{offset}".encode(), "T", {"UNIQ_KEY": f"ID{offset}"}, queue_offset=offset)
                            if code == SUCCESS else b"")
                    ext = {"nextBeginOffset": str(nxt), "minOffset": "0", "maxOffset": str(_END)}
                    reply = _with_ext(encode_response(code, req.opaque, None, body), ext)
                    threading.Timer(self.suspend_s if code == PULL_NOT_FOUND else 0.0, self._send,
                                    args=(sock, reply)).start()

    @staticmethod
    def _send(sock: socket.socket, reply: bytes) -> None:
        with contextlib.suppress(OSError):
            sock.sendall(reply)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


@contextlib.contextmanager
def _pulling(broker: RetryBroker, got: list[bytes], retry_backoff_s: float) -> Iterator[tuple[Puller, QueueTable]]:
    table = QueueTable()
    table.add(Q, 0)

    def take(batch: list[Any]) -> bool:
        got.extend(m.body for m in batch)
        return True

    # a long poll of 100 ms, requests of 1 s
    settings = PullSettings("g", "T", 32, 100, retry_backoff_s, 1.0, 4 << 20, 3, 64 << 20, None)
    membership = SimpleNamespace(address=lambda name: broker.addr, commit=lambda q, st: None)
    counters = {"batches": 0, "refused": 0, "pulled": 0, "undecodable": 0, "bad_answers": 0, "pull_gaps": 0}
    puller = Puller(settings, table, membership, take, lambda request: None, counters)  # type: ignore[arg-type]
    puller.running.set()
    puller.pull_from(Q[0])
    try:
        yield puller, table
    finally:
        puller.stop()
        broker.close()


def _removed_below(first: int) -> Rule:
    """Offsets below `first` answered PULL_RETRY_IMMEDIATELY with `first` next (their commit-log file
    is being removed); those from there found, one message each, up to the end."""
    def rule(offset: int) -> tuple[int, int]:
        if offset < first:
            return PULL_RETRY_IMMEDIATELY, first
        return (SUCCESS, offset + 1) if offset < _END else (PULL_NOT_FOUND, _END)
    return rule


def test_a_retry_answer_that_moves_the_offset_is_followed_after_the_gap_pulls_and_reported() -> None:
    broker = RetryBroker(_removed_below(3), suspend_s=0.1)
    got: list[bytes] = []
    with _pulling(broker, got, retry_backoff_s=0.05) as (puller, table):
        assert wait_for(lambda: got == [b"m3", b"m4"], timeout=5), (
            f"the queue never moved past offset 0: pulled {broker.pulls.count(0)} times there, got {got}")
        assert broker.pulls[:_puller._GAP_PULLS + 2] == [0] * (_puller._GAP_PULLS + 1) + [3], (
            "pulled again as many times as a gap is, then from where the broker said")
        assert puller.counters["pull_gaps"] == _puller._GAP_PULLS + 1
        assert table.offsets_moved == ["broker-a:0 0 -> 3 (3 not returned)"]
        assert puller.dead_threads() == []


def test_a_retry_answer_that_does_not_move_the_offset_is_pulled_again_after_the_backoff() -> None:
    broker = RetryBroker(lambda offset: (PULL_RETRY_IMMEDIATELY, offset), suspend_s=0.1)
    with _pulling(broker, [], retry_backoff_s=30.0) as (puller, table):
        st = table.get(Q)
        assert st is not None
        assert wait_for(lambda: st.retry_at > 0, timeout=5), (
            f"pulled again at once, {len(broker.pulls)} pulls of offset 0 so far")
        assert broker.pulls == [0] and st.offset == 0, "the next pull waits for the backoff (30 s)"
        assert puller.counters["pull_gaps"] == 0 and table.offsets_moved == []
