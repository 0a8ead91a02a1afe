"""The wire client against loopback peers that are not what the configuration says: another
protocol's server, a NameServer whose routes make no sense, a stream cut or silent. Each ends in a
typed error within its deadline, with the connection closed and nothing allocated from a claim."""
from __future__ import annotations

import json
import pickle
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from forwarder.rocketmq import Connection, OutgoingMessage, RemotingProducer
from forwarder.rocketmq.admin import queue_lags
from forwarder.rocketmq.errors import ConnectionFailedError, ProtocolError, RemotingError, RequestTimeoutError
from forwarder.rocketmq.lookup import MessageLookup
from forwarder.rocketmq.namesrv import MAX_ROUTE_QUEUES, NameServerClient, parse_route
from forwarder.rocketmq.protocol import SUCCESS, decode_request, encode_response, take_frame
from forwarder.rocketmq.security import ClientSecurity
from tests.forwarder.rocketmq._ca_file import make_ca_file

_IO_TIMEOUT_S = 10.0  # every socket operation of the peers: a failing test fails, never hangs
_REPO = Path(__file__).resolve().parents[3]

Handler = Callable[[socket.socket], None]


class Peer:
    """A loopback server that hands each connection to `handler` on a thread of its own."""

    def __init__(self, handler: Handler) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(_IO_TIMEOUT_S)
        self.addr = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._handler = handler
        #: set once the handler is through: the client closed its end (a handler that drains waits
        #: for that), never on a peer's own timeout
        self.done = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except OSError:
            return
        with sock:
            sock.settimeout(_IO_TIMEOUT_S)
            try:
                self._handler(sock)
            except ConnectionResetError:  # the client closed with bytes unread: closed all the same
                pass
            except OSError:  # a timeout: the client never closed
                return
            self.done.set()

    def close(self) -> None:
        self._listener.close()


@pytest.fixture
def peers() -> Iterator[Callable[[Handler], Peer]]:
    made: list[Peer] = []

    def make(handler: Handler) -> Peer:
        made.append(Peer(handler))
        return made[-1]

    yield make
    for p in made:
        p.close()


def _answering(body: bytes) -> Handler:
    """A NameServer answering every request SUCCESS with `body`."""
    def handle(sock: socket.socket) -> None:
        buf = bytearray()
        while chunk := sock.recv(65536):
            buf += chunk
            while (frame := take_frame(buf, "client")) is not None:
                req = decode_request(frame, "client")
                assert req is not None
                sock.sendall(encode_response(SUCCESS, req.opaque, None, body))
    return handle


def _route(addr: object, write_queues: int = 4) -> bytes:
    return json.dumps({"brokerDatas": [{"cluster": "c", "brokerName": "b", "brokerAddrs": {"0": addr}}],
                       "queueDatas": [{"brokerName": "b", "readQueueNums": write_queues,
                                       "writeQueueNums": write_queues, "perm": 6}]}).encode()


def _send_one(namesrv: str) -> object:
    with RemotingProducer(namesrv, "g", timeout_ms=2000) as p:
        [outcome] = p.send([OutgoingMessage("T", b"x")])
    return outcome


# -- a NameServer whose route makes no sense ------------------------------------------------------

_CLAIM_CHILD = """
import resource, sys
resource.setrlimit(resource.RLIMIT_DATA, (1 << 30, 1 << 30))
from forwarder.rocketmq import OutgoingMessage, RemotingProducer
with RemotingProducer(sys.argv[1], "g", timeout_ms=2000) as p:
    [outcome] = p.send([OutgoingMessage("T", b"x")])
print(type(outcome).__name__, outcome)
"""


@pytest.mark.parametrize("claim", [2 ** 31 - 1, MAX_ROUTE_QUEUES + 1])
def test_a_route_claiming_billions_of_queues_is_refused_before_they_are_listed(
        peers: Callable[[Handler], Peer], claim: int) -> None:
    ns = peers(_answering(_route("127.0.0.1:1", claim)))
    # in a process of its own, its heap bounded: listing the claim would take gigabytes
    res = subprocess.run([sys.executable, "-c", _CLAIM_CHILD, ns.addr], cwd=_REPO, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.startswith("ProtocolError") and f"claims {claim} queues" in res.stdout, res.stdout


@pytest.mark.parametrize("addr", [10911, "127.0.0.1", "127.0.0.1:99999", "127.0.0.1:0", ":10911", None])
def test_a_route_naming_a_broker_address_that_is_not_host_port_is_a_protocol_error(
        peers: Callable[[Handler], Peer], addr: object) -> None:
    ns = peers(_answering(_route(addr)))
    outcome = _send_one(ns.addr)
    assert isinstance(outcome, ProtocolError) and "not HOST:PORT" in str(outcome), outcome


def test_a_consumer_route_naming_a_broker_address_that_is_not_host_port_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="not HOST:PORT"):
        parse_route("T", json.loads(_route(10911)), readable=True)


def test_a_route_nested_deeper_than_any_parser_goes_is_a_protocol_error(peers: Callable[[Handler], Peer]) -> None:
    ns = peers(_answering(b"[" * 100_000))
    outcome = _send_one(ns.addr)
    assert isinstance(outcome, ProtocolError) and "is not JSON" in str(outcome), outcome


def test_a_route_naming_no_broker_for_the_topic_is_topic_not_found(peers: Callable[[Handler], Peer]) -> None:
    ns = peers(_answering(json.dumps({"brokerDatas": [], "queueDatas": []}).encode()))
    outcome = _send_one(ns.addr)
    assert isinstance(outcome, RemotingError) and "no writable queue" in str(outcome), outcome


# -- another protocol's server where RocketMQ was expected ----------------------------------------

def _http(sock: socket.socket) -> None:
    sock.recv(1024)
    sock.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    sock.recv(1024)  # until the client closes


def _ssh(sock: socket.socket) -> None:
    sock.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
    while sock.recv(1024):
        pass


def _tls_alert(sock: socket.socket) -> None:
    sock.recv(1024)
    sock.sendall(b"\x15\x03\x01\x00\x02\x02\x46")  # a fatal alert: what a TLS server answers plaintext with
    sock.recv(1024)


@pytest.mark.parametrize("handler, like, check", [
    (_http, "HTTP", "--namesrv"), (_ssh, "SSH", "--namesrv"), (_tls_alert, "TLS", "tls = true")])
def test_a_peer_that_speaks_another_protocol_is_named_as_such(
        peers: Callable[[Handler], Peer], handler: Handler, like: str, check: str) -> None:
    peer = peers(handler)
    client = NameServerClient(peer.addr, 2.0)
    try:
        with pytest.raises(ConnectionFailedError) as caught:
            client.route_document("T")
    finally:
        client.close()
    assert f"does not speak RocketMQ (it answered like {like})" in str(caught.value)
    assert check in str(caught.value)
    assert peer.done.wait(_IO_TIMEOUT_S), "the connection is closed after the error"


def _plain_until_closed(sock: socket.socket) -> None:
    sock.recv(1024)  # the ClientHello
    sock.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    while sock.recv(1024):
        pass


def _silent_until_closed(sock: socket.socket) -> None:
    while sock.recv(1024):
        pass


def test_a_tls_handshake_answered_in_plaintext_says_to_check_tls(peers: Callable[[Handler], Peer]) -> None:
    peer = peers(_plain_until_closed)
    with pytest.raises(ConnectionFailedError, match="over TLS") as caught:
        Connection(peer.addr, 2.0, ClientSecurity(tls=True, tls_insecure=True))
    assert "does not answer in TLS" in str(caught.value) and "tls = false" in str(caught.value)
    assert peer.done.wait(_IO_TIMEOUT_S), "the socket is closed after the handshake failed"


def test_a_tls_handshake_never_answered_ends_within_the_timeout(peers: Callable[[Handler], Peer]) -> None:
    peer = peers(_silent_until_closed)
    with pytest.raises(ConnectionFailedError, match="over TLS"):
        Connection(peer.addr, 0.5, ClientSecurity(tls=True, tls_insecure=True))
    assert peer.done.wait(_IO_TIMEOUT_S), "the socket is closed after the handshake failed"


def test_a_tls_setting_that_cannot_be_used_closes_the_socket_it_opened(peers: Callable[[Handler], Peer],
                                                                        tmp_path: Path) -> None:
    """Settings shipped elsewhere (a Spark executor's copy) build their TLS context at the first
    connection: a CA file missing there is named, and the socket opened for it closed."""
    peer = peers(_silent_until_closed)
    ca = make_ca_file(tmp_path)
    shipped = pickle.dumps(ClientSecurity(tls=True, ca_file=str(ca)))
    ca.unlink()
    held: list[ConnectionFailedError] = []
    try:
        Connection(peer.addr, 2.0, pickle.loads(shipped))
    except ConnectionFailedError as e:
        held.append(e)  # as a caller keeps it to report: with it the frame that opened the socket
    assert held and "over TLS" in str(held[0]) and f"rocketmq.tls_ca_file = {str(ca)!r}" in str(held[0])
    assert peer.done.wait(_IO_TIMEOUT_S), "the socket stays open after the error"


def test_a_plaintext_connection_to_a_tls_server_is_refused(peers: Callable[[Handler], Peer], tmp_path: Path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=localhost"], check=True, capture_output=True, timeout=60)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)

    def tls_server(sock: socket.socket) -> None:
        try:
            ctx.wrap_socket(sock, server_side=True).close()
        except ssl.SSLError:
            pass

    peer = peers(tls_server)
    conn = Connection(peer.addr, 2.0)
    with pytest.raises((ConnectionFailedError, ProtocolError)):
        conn.request(105, {"topic": "T"}, b"", time.monotonic() + 2.0)
    assert conn.closed


# -- a remoting peer that misbehaves ---------------------------------------------------------------

def _answers_then_holds(raw: bytes) -> Handler:
    def handle(sock: socket.socket) -> None:
        sock.recv(65536)
        sock.sendall(raw)
        while sock.recv(1024):
            pass
    return handle


def _answers_then_closes(raw: bytes) -> Handler:
    def handle(sock: socket.socket) -> None:
        sock.recv(65536)
        sock.sendall(raw)
        sock.shutdown(socket.SHUT_WR)
        while sock.recv(1024):
            pass
    return handle


@pytest.mark.parametrize("handler, error", [
    (_answers_then_holds(b"\x7f\xff\xff\xff"), ProtocolError),  # 2 GiB
    (_answers_then_holds(b"\xff\xff\xff\xff"), ProtocolError),  # 4 GiB unsigned, -1 signed
    (_answers_then_holds(b"\x80\x00\x00\x00"), ProtocolError),  # negative
    (_answers_then_holds(b"\x00\x00\x00\x08\x00\x00\x10\x00abcd"), ProtocolError),  # header longer than its frame
    (_answers_then_closes(b"\x00\x00\x01\x00\x00\x00\x00\x10{\"code\":0"), ConnectionFailedError),  # cut mid-frame
    (_answers_then_holds(b""), RequestTimeoutError),  # never answers
], ids=["2GiB", "4GiB", "negative", "header-past-frame", "cut-mid-frame", "silent"])
def test_a_peer_that_breaks_the_framing_ends_the_request_and_the_connection(
        peers: Callable[[Handler], Peer], handler: Handler, error: type[RemotingError]) -> None:
    peer = peers(handler)
    conn = Connection(peer.addr, 2.0)
    # a length believed would wait for its bytes and end in a timeout: the error comes at once instead
    with pytest.raises(error):
        conn.request(105, {"topic": "T"}, b"", time.monotonic() + 1.0)
    assert conn.closed and peer.done.wait(_IO_TIMEOUT_S)


def test_a_connection_to_an_address_whose_port_is_out_of_range_is_refused_before_connecting() -> None:
    with pytest.raises(ConnectionFailedError, match="not HOST:PORT"):
        Connection("127.0.0.1:99999", 1.0)


@pytest.mark.parametrize("addr", [10911, "127.0.0.1:99999"])
def test_the_lag_look_up_over_a_route_that_makes_no_sense_is_a_protocol_error(
        peers: Callable[[Handler], Peer], addr: object) -> None:
    """`timewheel status` and the ingest lag read routes through `queue_lags`: an untyped error there
    was a traceback where the look-ups beside it say what is wrong."""
    ns = peers(_answering(_route(addr)))
    with pytest.raises(ProtocolError, match="not HOST:PORT"):
        queue_lags(ns.addr, "g", "T", timeout=2.0)


def test_the_look_up_of_a_copy_over_a_route_naming_a_bad_address_is_a_protocol_error(
        peers: Callable[[Handler], Peer]) -> None:
    ns = peers(_answering(_route("127.0.0.1:99999")))
    lookup = MessageLookup(ns.addr, timeout_ms=2000)
    try:
        with pytest.raises(ProtocolError, match="not HOST:PORT"):
            lookup.brokers("T")
    finally:
        lookup.close()
