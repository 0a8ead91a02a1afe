"""One TCP connection to a NameServer or a broker: requests pipelined, answers matched by opaque."""
from __future__ import annotations

import itertools
import logging
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from forwarder.rocketmq.acl import sign
from forwarder.rocketmq.errors import ConnectionFailedError, FencedError, RemotingError, RequestTimeoutError
from forwarder.rocketmq.protocol import (REQUEST_CODE_NOT_SUPPORTED, SYSTEM_ERROR, Reply, Request, Response,
                                         decode_request, decode_response, encode_request, encode_response, take_frame)
from forwarder.rocketmq.security import ClientSecurity

__all__ = ["Connection", "RequestHandler", "call"]

log = logging.getLogger("timewheel.remoting")
#: why a request a fence held back was not written (`Connection.submit`)
FENCED_NOTE = "not sent: the sender's lease deadline passed"

_RECV_CHUNK = 256 * 1024
#: a socket timeout up to this share of the connection's timeout longer than a deadline needs is
#: kept: setting it costs a system call, and a deadline set a moment ago is nearly the timeout
_TIMEOUT_SLACK = 0.05

#: frames `Connection.serve_requests` reads at most a call
SERVE_LIMIT = 64

#: why a TLS handshake met an answer that is not TLS
_NOT_TLS = " (the peer does not answer in TLS: if it expects plaintext, set tls = false under [rocketmq])"

#: Answers a request the peer sent (a broker asking its client); None: no answer (one-way notices).
RequestHandler = Callable[[Request], Reply | None]


class Connection:
    """One TCP connection to a NameServer or broker; requests are pipelined and matched by opaque.

    Not thread-safe by itself: callers hold `lock` from `submit` to the matching `collect`.
    """

    def __init__(self, addr: str, timeout: float, security: ClientSecurity | None = None,
                 on_request: RequestHandler | None = None) -> None:
        """Connect to "host:port" within `timeout` seconds (TLS and request signing as `security`
        says); ConnectionFailedError if that fails.

        Requests the peer sends on this connection are answered by `on_request` whenever frames are
        read (and by `serve_requests` while nothing is awaited); without it, every such request is
        answered "not supported", as RocketMQ's own remoting does for a code it has no processor for.
        """
        self.addr = addr
        self._timeout = timeout
        self._on_request = on_request
        self.lock = threading.Lock()
        self._credentials = security.credentials if security is not None else None
        host, port = _host_port(addr)
        sock: socket.socket | None = None
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            ctx = security.context() if security is not None else None
            self._sock: socket.socket = sock if ctx is None else ctx.wrap_socket(
                sock, server_hostname=host if ctx.check_hostname else None)
        except (OSError, ValueError) as e:
            # a TLS context it could not build (a CA file it cannot read): the caller may keep the
            # error, and with it this frame, for as long as it likes; the socket must not go with it
            if sock is not None:
                sock.close()
            hint = _NOT_TLS if isinstance(e, ssl.SSLError) and e.reason == "WRONG_VERSION_NUMBER" else ""
            raise ConnectionFailedError(f"cannot connect to {addr}"
                                        f"{' over TLS' if security and security.tls else ''}: {e}{hint}") from e
        self._tls = isinstance(self._sock, ssl.SSLSocket)
        self._sock_timeout = timeout  # what the socket has, as `create_connection` set it
        self.last_used = time.monotonic()  # of the last request written
        self._poll = select.poll()
        self._poll.register(self._sock, select.POLLIN)
        self._opaque = itertools.count(1)
        self._buf = bytearray()
        self.closed = False

    @property
    def local_ip(self) -> str:
        """The address this side of the connection has (what the peer sees)."""
        return str(self._sock.getsockname()[0])

    def alive(self) -> bool:
        """False once the peer closed the connection (a restarted broker, an idle timeout).

        A connection another thread is using counts as alive: that thread finds out if it is not.
        Peeking under its feet would race it for the bytes, then wait out its socket timeout.
        """
        if self.closed:
            return False
        if not self.lock.acquire(blocking=False):
            return True
        try:
            if self._tls:  # no peeking inside TLS records: a closed peer shows at the next request
                return True
            if self._poll.poll(0):  # readable while nothing is awaited: end of stream, or a stray frame
                try:
                    if not self._sock.recv(1, socket.MSG_PEEK):
                        self.close()
                except OSError:
                    self.close()
        finally:
            self.lock.release()
        return not self.closed

    def submit(self, requests: Sequence[tuple[int, Mapping[str, str], bytes]], deadline: float,
               fence: Callable[[], bool] | None = None) -> list[int]:
        """Write requests (code, extFields, body) in one go; return their opaques. `fence`, if given,
        is asked last, once the bytes are ready and right before the write: False raises
        `FencedError` with nothing written (a lease's last look at the clock: the less work after
        it, the smaller the window a pause there leaves)."""
        opaques = [next(self._opaque) for _ in requests]
        creds = self._credentials
        data = b"".join(encode_request(code, o, ext if creds is None else sign(ext, body, creds), body)
                        for o, (code, ext, body) in zip(opaques, requests))
        if fence is not None and not fence():
            raise FencedError(FENCED_NOTE)
        try:
            self.last_used = now = time.monotonic()
            self._timeout_for(max(deadline - now, 0.001))
            self._sock.sendall(data)
        except TimeoutError as e:
            self.close()
            raise RequestTimeoutError(f"writing {len(requests)} request(s) to {self.addr} timed out") from e
        except OSError as e:
            self.close()
            raise ConnectionFailedError(f"connection to {self.addr} broke while writing: {e}") from e
        return opaques

    def collect(self, opaques: Iterable[int], deadline: float) -> dict[int, Response | RemotingError]:
        """Read until every opaque is answered; on failure the unanswered ones get the error."""
        waiting = set(opaques)
        out: dict[int, Response | RemotingError] = {}
        try:
            while waiting:
                resp = self.read_response(deadline)
                if resp.opaque in waiting:
                    waiting.discard(resp.opaque)
                    out[resp.opaque] = resp
                # else: the answer to a request given up on earlier; nobody waits for it any more
        except RemotingError as e:
            self.close()
            out.update((o, e) for o in waiting)
        return out

    def request(self, code: int, ext: Mapping[str, str], body: bytes, deadline: float) -> Response:
        """One request and its response; raises the RemotingError instead of returning it."""
        with self.lock:
            [opaque] = self.submit([(code, ext, body)], deadline)
            answer = self.collect([opaque], deadline)[opaque]
        if isinstance(answer, RemotingError):
            raise answer
        return answer

    def readable(self, timeout: float) -> bool:
        """Whether a frame may be read now: bytes are buffered, or arrive within `timeout` seconds."""
        if self._buf or (self._tls and self._sock.pending()):  # type: ignore[attr-defined]
            return True
        return bool(self._poll.poll(timeout * 1000))

    def read_response(self, deadline: float) -> Response:
        """The next response frame (requests the peer sends meanwhile are answered on the way)."""
        while True:
            frame = self._read_frame(deadline)
            resp = decode_response(frame, self.addr)
            if resp is not None:
                return resp
            self._answer(frame)

    def serve_requests(self, limit: int = SERVE_LIMIT) -> int:
        """Answer the requests the peer sent while nothing was awaited, without blocking; how many.

        At most `limit` frames a call: a peer that keeps sending would otherwise hold the caller (a
        consumer's rebalance thread) here for good; the rest wait for the next call.
        A connection another thread is using is left alone: that thread answers them as it reads.
        """
        if self.closed or not self.lock.acquire(blocking=False):
            return 0
        served = 0
        read = 0
        try:
            while read < limit and not self.closed and self.readable(0):
                read += 1
                frame = self._read_frame(time.monotonic() + self._timeout)
                if decode_response(frame, self.addr) is None:  # else: an answer nobody waits for any more
                    self._answer(frame)
                    served += 1
        except RemotingError as e:
            log.warning("connection to %s broke while serving its requests: %s", self.addr, e)
            self.close()
        finally:
            self.lock.release()
        return served

    def _answer(self, frame: bytes) -> None:
        """Answer one request frame of the peer's (the caller holds `lock`)."""
        req = decode_request(frame, self.addr)
        if req is None:
            return
        reply: Reply | None
        if self._on_request is None:
            reply = (REQUEST_CODE_NOT_SUPPORTED, f"request code {req.code} is not supported by this client", b"")
        else:
            try:
                reply = self._on_request(req)
            except Exception as e:  # the peer gets an error answer; the connection goes on
                log.exception("answering request %d from %s failed", req.code, self.addr)
                reply = (SYSTEM_ERROR, f"the client failed to answer request {req.code}: {e}", b"")
        if reply is None or req.oneway:
            return
        code, remark, body = reply
        try:
            self._timeout_for(self._timeout)
            self._sock.sendall(encode_response(code, req.opaque, remark, body))
        except OSError as e:
            self.close()
            raise ConnectionFailedError(f"connection to {self.addr} broke while answering its request: {e}") from e

    def _read_frame(self, deadline: float) -> bytes:
        """Bytes of the next frame after its length field."""
        buf = self._buf
        while True:
            frame = take_frame(buf, self.addr)
            if frame is not None:
                return frame
            left = deadline - time.monotonic()
            if left <= 0:
                raise RequestTimeoutError(f"no answer from {self.addr} in time")
            try:
                self._timeout_for(left)
                chunk = self._sock.recv(_RECV_CHUNK)
            except TimeoutError as e:  # `_timeout_for` never ends it before the deadline
                raise RequestTimeoutError(f"no answer from {self.addr} in time") from e
            except OSError as e:
                raise ConnectionFailedError(f"connection to {self.addr} broke while reading: {e}") from e
            if not chunk:
                raise ConnectionFailedError(f"{self.addr} closed the connection")
            buf += chunk

    def _timeout_for(self, left: float) -> None:
        """Give the socket a timeout that ends an operation no earlier than `left` seconds from now,
        nor much later: the one it has when that is within `_TIMEOUT_SLACK` (no system call)."""
        current = self._sock_timeout
        if left > current or left < current - self._timeout * _TIMEOUT_SLACK:
            self._sock.settimeout(left)
            self._sock_timeout = left

    def close(self) -> None:
        """Close the socket (idempotent)."""
        if not self.closed:
            self.closed = True
            try:
                self._sock.close()
            except OSError:
                pass


def host_port_ok(addr: object) -> bool:
    """Whether `addr` is "host:port" with a port of ASCII digits from 1 to 65535 (the resolver would
    take a port out of range modulo 65536 and connect elsewhere)."""
    host, _, port = addr.rpartition(":") if isinstance(addr, str) else ("", "", "")
    return bool(host) and port.isascii() and port.isdigit() and 0 < int(port) < 65536


def _host_port(addr: str) -> tuple[str, int]:
    """The host and port of "host:port"; ConnectionFailedError if it is not that (`host_port_ok`)."""
    if not host_port_ok(addr):
        raise ConnectionFailedError(f"cannot connect to {addr!r}: it is not HOST:PORT (a port from 1 to 65535)")
    host, _, port = addr.rpartition(":")
    return host, int(port)


def call(addr: str, code: int, ext: Mapping[str, str], body: bytes, timeout: float,
         security: ClientSecurity | None = None) -> Response:
    """One request on a connection of its own (admin requests, one-off look-ups), closed after."""
    conn = Connection(addr, timeout, security)
    try:
        return conn.request(code, ext, body, time.monotonic() + timeout)
    finally:
        conn.close()
