"""A small HTTP/1.1 server for the admin endpoint, bounded in every dimension a client controls.

The standard library's `ThreadingHTTPServer` gives each connection a thread with no timeout and
trusts `Content-Length`: a few hundred idle sockets or one streamed body could hold the admin
port, and with it `/healthz`, hostage. Here one event loop (its own thread) serves every connection:

- the request head is read with a size limit (`max_head_bytes`) and a deadline (`read_timeout_s`);
  an idle keep-alive connection is closed after `idle_timeout_s`; an answer the client does not
  read within `write_timeout_s` closes the connection (a client that pipelines requests and never
  reads cannot hold a connection for good);
- at most `max_connections` are open, and never more than a quarter of the process's soft limit
  on open files (`RLIMIT_NOFILE`): idle admin connections cannot starve the engine of descriptors;
  when all are taken, the one that has waited longest for (the rest of) a request is closed to make
  room, so that sockets left open and asking nothing cannot keep a probe from `/readyz`: only
  connections whose requests are being answered make a newcomer wait for a 503;
- a request whose head or body does not arrive within `read_timeout_s` is answered 408;
- the query must be UTF-8 once percent-decoded (400): a stand-in character would name another id;
- `Content-Length` must be ASCII digits within `max_body_bytes`, else 400/413 and the connection
  closes without reading the body; chunked bodies are refused (411): no admin request needs one;
- a method the handler takes on no path (`methods`) is answered 501 naming it, without calling the
  handler: 405 is the handler's, for a path asked with a method it takes elsewhere;
- a request the caller's `screen` refuses on its head alone (a missing token) is answered before
  its body is read, and the body is read away without being kept: an unauthenticated client cannot
  make the server hold a body;
- handlers run on a small thread pool (they may take the engine's locks), except those the caller
  marks inline (health probes), which answer even while every worker is busy.

`parse_head` and `body_length` are pure functions over bytes, fuzzed by the tests.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import resource
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, urlsplit

from timewheel.errors import TimewheelError

log = logging.getLogger("timewheel.app.http")

#: the methods a server takes unless told which its handler answers
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE"})
#: what RFC 9110 lets a method name be (a token)
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


@dataclass(frozen=True)
class HttpLimits:
    """What one client may ask of the server."""

    max_head_bytes: int = 16 * 1024
    max_headers: int = 64
    max_body_bytes: int = 1 << 20
    read_timeout_s: float = 10.0
    write_timeout_s: float = 10.0
    idle_timeout_s: float = 30.0
    max_connections: int = 512
    handler_threads: int = 4


def raise_open_files_limit(want: int = 65536) -> int:
    """Raise the soft limit on open files toward `want` (within the hard limit); returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-files limit from %d to %d: %s", soft, target, e)
    return soft


def connection_cap(max_connections: int) -> int:
    """`max_connections`, held to a quarter of the soft limit on open files (the rest is the engine's)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max_connections if soft == resource.RLIM_INFINITY else max(1, min(max_connections, soft // 4))


class HttpStartError(TimewheelError, RuntimeError):
    """The server did not start serving: its event loop could not listen, or did not within the bound."""


class HttpError(Exception):
    """A request the server refuses: the status to answer and why; the connection closes after."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class Request:
    """A parsed request: method, path, query parameters, headers (lower-case names) and body."""

    method: str
    path: str
    query: Mapping[str, list[str]]
    headers: Mapping[str, str]
    body: bytes = b""
    version: str = "HTTP/1.1"


@dataclass(frozen=True)
class Response:
    """What a handler answers."""

    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def json(cls, status: int, obj: Any) -> "Response":
        """A JSON response."""
        return cls(status, (json.dumps(obj) + "\n").encode())


Handler = Callable[[Request], Response]


def parse_head(head: bytes, limits: HttpLimits = HttpLimits(), methods: frozenset[str] = METHODS) -> Request:
    """Parse a request line and headers (ending in a blank line); HttpError if malformed or too big,
    501 for a method not in `methods`."""
    if len(head) > limits.max_head_bytes:
        raise HttpError(431, f"request head over {limits.max_head_bytes} bytes")
    try:
        text = head.decode("latin-1")
    except UnicodeDecodeError as e:  # latin-1 decodes every byte; kept for clarity of intent
        raise HttpError(400, "undecodable request head") from e
    lines = text.split("\r\n")
    while lines and lines[-1] == "":
        lines.pop()
    if not lines:
        raise HttpError(400, "empty request")
    parts = lines[0].split(" ")
    if len(parts) != 3:
        raise HttpError(400, "malformed request line")
    method, target, version = parts
    if not _TOKEN.fullmatch(method):
        raise HttpError(400, "malformed request line: the method is not a token")
    if method not in methods:
        # RFC 9110: 405 is for a method the target does not take; one no target takes is 501
        raise HttpError(501, f"method {method[:16]!r} is not implemented: this server takes "
                             f"{', '.join(sorted(methods))}")
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise HttpError(505, "only HTTP/1.0 and HTTP/1.1 are spoken")
    if not target.startswith("/") or any(c in target for c in "\x00\r\n\t "):
        raise HttpError(400, "malformed request target")
    if len(lines) - 1 > limits.max_headers:
        raise HttpError(431, f"more than {limits.max_headers} headers")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip() or any(not (c.isascii() and c.isprintable()) or c in " \t"
                                                                for c in name):
            raise HttpError(400, "malformed header line")
        key = name.lower()
        value = value.strip(" \t")
        if key in headers:
            if key in ("content-length", "transfer-encoding", "host", "authorization"):
                raise HttpError(400, f"header {name!r} given twice")
            headers[key] = headers[key] + ", " + value
        else:
            headers[key] = value
    try:
        url = urlsplit(target)  # "/[" reads as an unclosed IPv6 host
        query = parse_qs(url.query, keep_blank_values=True, max_num_fields=32, strict_parsing=False,
                         errors="strict")
    except UnicodeDecodeError as e:
        raise HttpError(400, f"the query is not UTF-8 once percent-decoded (byte {e.object[e.start:e.start + 1]!r} "
                             f"at {e.start}): percent-encode the UTF-8 bytes of each value") from e
    except ValueError as e:
        raise HttpError(400, f"malformed target or query: {e}") from e
    # the path as sent: a target is always origin-form here, so a doubled "/" (which urlsplit would
    # read as a host) stays part of the path, and the request matches no route instead of another one
    path = target.partition("#")[0].partition("?")[0]
    return Request(method, path, query, headers, b"", version)


def body_length(headers: Mapping[str, str], limits: HttpLimits = HttpLimits()) -> int:
    """The body's length from its headers: ASCII digits within the limit; HttpError otherwise."""
    if "transfer-encoding" in headers:
        raise HttpError(411, "chunked bodies are not accepted: send Content-Length")
    raw = headers.get("content-length")
    if raw is None or raw == "":
        return 0
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 12:
        raise HttpError(400, f"Content-Length {raw[:24]!r} is not a byte count")
    n = int(raw)
    if n > limits.max_body_bytes:
        raise HttpError(413, f"body of {n} bytes is over the limit of {limits.max_body_bytes}")
    return n


def _encode(resp: Response, *, keep_alive: bool, head_only: bool = False) -> bytes:
    try:
        phrase = HTTPStatus(resp.status).phrase
    except ValueError:
        phrase = "Unknown"
    lines = [f"HTTP/1.1 {resp.status} {phrase}", f"Content-Type: {resp.content_type}",
             f"Content-Length: {len(resp.body)}", f"Connection: {'keep-alive' if keep_alive else 'close'}"]
    lines += [f"{k}: {v}" for k, v in resp.headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (b"" if head_only else resp.body)


@dataclass
class _Connection:
    """One open connection: since when it waits for a request (or the rest of one); None while answered."""

    writer: asyncio.StreamWriter
    waiting_since: float | None


class HttpServer:
    """Serves `handler` on HOST:PORT (port 0 picks a free one) from one event-loop thread."""

    def __init__(self, host: str, port: int, handler: Handler, limits: HttpLimits = HttpLimits(), *,
                 inline: Callable[[Request], bool] = lambda r: False, name: str = "timewheel-http",
                 methods: frozenset[str] = METHODS,
                 screen: Callable[[Request], Response | None] = lambda r: None) -> None:
        self.handler = handler
        self.limits = limits
        self.inline = inline
        #: the answer to a request refused on its head alone (None: read its body and call the handler);
        #: it runs on the event loop, so it must be quick and take no lock the handlers hold
        self.screen = screen
        #: the methods `handler` answers on some path; any other is refused before it is called (501)
        self.methods = methods
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # Bound now, so that the address (and a port in use) is known before start().
        self._sock = socket.create_server((host, port), family=family, backlog=128)
        self._pool = ThreadPoolExecutor(limits.handler_threads, thread_name_prefix=f"{name}-handler")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = threading.Event()
        self._start_failure: Exception | None = None  # why the event loop could not listen, for start()
        self._server: asyncio.AbstractServer | None = None
        self._connections: dict[asyncio.StreamWriter, _Connection] = {}  # touched on the loop's thread only
        #: connections served at once: `limits.max_connections` within a quarter of the open-files limit
        self.max_connections = connection_cap(limits.max_connections)

    @property
    def open_connections(self) -> int:
        """Connections open now."""
        return len(self._connections)

    @property
    def address(self) -> str:
        """HOST:PORT actually bound."""
        host, port = self._sock.getsockname()[:2]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def start(self, timeout_s: float = 10.0) -> "HttpServer":
        """Serve in the background; returns once listening. HttpStartError, the server stopped and its
        port let go, if its event loop cannot listen or does not within `timeout_s` seconds."""
        self._thread.start()
        came_up = self._started.wait(timeout_s)
        failure = self._start_failure
        if came_up and failure is None:
            return self
        address = self.address
        self.stop()
        if failure is not None:
            raise HttpStartError(f"the HTTP server on {address} could not start serving: {failure}") from failure
        raise HttpStartError(f"the HTTP server on {address} did not start serving within {timeout_s:g} s (its "
                             "event-loop thread did not get to listen: a process short of CPU, or stuck?); it was stopped")

    def stop(self) -> None:
        """Stop accepting, close every connection and the thread pool."""
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
        # never served, or its start failed: its thread did not close the loop (and its descriptors)
        if not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._sock.close()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._serve, sock=self._sock, limit=self.limits.max_head_bytes + 4))
        except Exception as e:  # start() raises it: a thread that ended must not leave start() waiting
            self._end_tasks()
            self._start_failure = e
            self._started.set()
            return
        self._started.set()
        try:
            self._loop.run_forever()
        finally:
            self._server.close()
            self._end_tasks()
            self._loop.close()

    def _end_tasks(self) -> None:
        """Cancel what still runs on the loop (not running) and let it end: every connection's socket closed."""
        tasks = asyncio.all_tasks(self._loop)
        for task in tasks:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._connections) >= self.max_connections and not self._make_room():
            writer.write(_encode(Response.json(503, {"error": "too many connections, each being answered"}),
                                 keep_alive=False))
            await self._close(writer)
            return
        conn = self._connections[writer] = _Connection(writer, time.monotonic())
        try:
            await self._requests(reader, conn)
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            pass
        except asyncio.CancelledError:  # the server stops: close without waiting, and end quietly
            writer.close()
            return
        finally:
            self._connections.pop(writer, None)
        await self._close(writer)

    def _make_room(self) -> bool:
        """Close the connection that has waited longest for a request; False if every one is being answered."""
        waiting = [c for c in self._connections.values() if c.waiting_since is not None]
        if not waiting:
            return False
        oldest = min(waiting, key=lambda c: c.waiting_since or 0.0)
        del self._connections[oldest.writer]  # its slot is the newcomer's now; its task ends on the lost connection
        oldest.writer.transport.abort()
        return True

    async def _requests(self, reader: asyncio.StreamReader, conn: _Connection) -> None:
        limits, writer = self.limits, conn.writer
        while True:
            conn.waiting_since = time.monotonic()
            first = await asyncio.wait_for(reader.readexactly(1), limits.idle_timeout_s)
            try:
                head = first + await self._read(reader.readuntil(b"\r\n\r\n"), "request head")
                req = parse_head(head, limits, self.methods)
                n = body_length(req.headers, limits)
                if n and (refused := self.screen(req)) is not None:
                    await self._refuse_before_body(reader, writer, refused, n)
                    return
                if n and req.headers.get("expect", "").lower() == "100-continue":
                    # curl asks before a body over 1 KiB and waits a second for this before sending anyway
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    await writer.drain()
                body = await self._read(reader.readexactly(n), f"body of the {n} bytes its Content-Length says") \
                    if n else b""
            except asyncio.LimitOverrunError:
                await self._refuse(writer, HttpError(431, f"request head over {limits.max_head_bytes} bytes"))
                return
            except HttpError as e:
                await self._refuse(writer, e)
                return
            conn.waiting_since = None
            req = Request(req.method, req.path, req.query, req.headers, body, req.version)
            keep_alive = req.version == "HTTP/1.1" and req.headers.get("connection", "").lower() != "close"
            resp = await self._answer(req)
            writer.write(_encode(resp, keep_alive=keep_alive, head_only=req.method == "HEAD"))
            await asyncio.wait_for(writer.drain(), limits.write_timeout_s)
            if not keep_alive:
                return

    async def _read(self, read: Coroutine[Any, Any, bytes], what: str) -> bytes:
        """What `read` returns within `read_timeout_s`; HttpError 408 naming `what` did not arrive."""
        try:
            return await asyncio.wait_for(read, self.limits.read_timeout_s)
        except TimeoutError:
            raise HttpError(408, f"the {what} did not arrive within {self.limits.read_timeout_s:g} s") from None

    async def _answer(self, req: Request) -> Response:
        try:
            if self.inline(req):
                return self.handler(req)
            return await asyncio.get_running_loop().run_in_executor(self._pool, self.handler, req)
        except HttpError as e:
            return Response.json(e.status, {"error": e.reason})
        except Exception:
            log.exception("admin request %s %s failed", req.method, req.path)
            return Response.json(500, {"error": "internal error: see the engine's log"})

    async def _refuse_before_body(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                                  resp: Response, n: int) -> None:
        """Answer `resp` and close, reading the `n` body bytes away unkept (closing with them unread would
        reset the connection, and the client could lose the answer), for `read_timeout_s` at most."""
        writer.write(_encode(resp, keep_alive=False))
        await asyncio.wait_for(writer.drain(), self.limits.write_timeout_s)
        deadline = time.monotonic() + self.limits.read_timeout_s
        while n > 0 and (left := deadline - time.monotonic()) > 0:
            try:
                chunk = await asyncio.wait_for(reader.read(min(n, 65536)), left)
            except (TimeoutError, ConnectionError):
                return
            if not chunk:
                return
            n -= len(chunk)

    async def _refuse(self, writer: asyncio.StreamWriter, err: HttpError) -> None:
        writer.write(_encode(Response.json(err.status, {"error": err.reason}), keep_alive=False))
        await asyncio.wait_for(writer.drain(), self.limits.write_timeout_s)

    @staticmethod
    async def _close(writer: asyncio.StreamWriter) -> None:
        try:
            writer.close()  # flushes what is buffered first: a client that never reads would keep it open
            await asyncio.wait_for(writer.wait_closed(), 1.0)
        except TimeoutError:
            writer.transport.abort()  # drop the unread answer, and with it the socket
        except (ConnectionError, OSError):
            pass
