"""The admin HTTP endpoint: health, readiness, Prometheus metrics, and token-guarded mutations.

    GET  /healthz                 200 while the process serves requests
    GET  /readyz                  200 once the engine runs and consumes, else 503 with why
    GET  /metrics                 Prometheus text
    GET  /stats                   the engine's and RocketMQ's counters (JSON, epoch ms)
    GET  /status                  one screen for on call: ingest lag, pending, lateness (JSON, epoch ms);
                                  computed at most once every `STATUS_CACHE_S` (it asks every broker)
    POST /cancel?id=ID | ?key=K   cancel on every engine of the delay topic (a control message to each of
                                  its queues); answers how many this engine cancelled and where
                                  (`applied_on`: engine, holder or standby; `promise`: false on a
                                  standby, whose lease holder may still send); needs
                                  "Authorization: Bearer <token>"; 503 if not every queue took it,
                                  if the engine is starting or stopping (nothing applied), if
                                  the disk refused its record (what it did holds; ask again), or
                                  if the meta store is corrupt (its words say what to do)
    GET  /messages?id=ID | ?key=K [&limit=N]
                                  stored messages with that id or business key and their timelines
                                  (`timewheel.find`: stored, cancels, send attempts with the broker's
                                  message id, dead letter, pending); at most `limit` (default 20, at
                                  most 1000); needs the token: it shows keys and topics; 503 if the
                                  engine is starting or stopping, or its storage failed the look-up
                                  (a corrupt meta store: its words say what to do)
    GET  /shaping                 the traffic rules in force (JSON)
    PUT  /shaping                 replace the rules (JSON body); needs the token; 503 while starting or stopping

Mutations and message look-ups are refused with 403 when no token is configured, 401 when the
request's is wrong. A path asked with a method it does not take is answered 405 with `Allow`, a method
no path takes (PATCH, DELETE, ...) 501; paths are matched exactly (`//readyz` is a 404), as a proxy in
front that filters by path sees them.
It listens on loopback unless configured otherwise. The HTTP server (`_http`) bounds what a client
can hold: head, body (1 MiB), connections, time; health and readiness answer on its event loop,
the rest on a small pool, so a slow cancel or scrape never keeps `/healthz` waiting.
"""
from __future__ import annotations

import hmac
import json
import logging
import re
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from storage import MetaStoreCorruptError, StorageError, StorageWriteError
from timewheel.app._http import HttpError, HttpLimits, HttpServer, Request, Response
from timewheel.errors import ConfigError, EngineStateError

if TYPE_CHECKING:
    from timewheel.app.cancel import CancelAnswer

log = logging.getLogger("timewheel.app.admin")
#: how long one `/status` answer serves every caller: it opens a connection to the NameServer and
#: one to each broker, and needs no authentication
STATUS_CACHE_S = 2.0
#: routes that need the token (they change the engine, or show keys and topics)
_GUARDED = frozenset({("GET", "/messages"), ("POST", "/cancel"), ("PUT", "/shaping")})


class AdminTarget(Protocol):
    """What the admin endpoint drives (the Service)."""

    def ready(self) -> bool:
        """Whether the engine runs and consumes."""
        ...

    def not_ready_why(self) -> list[str]:
        """Why it is not ready, a line each (none: ready)."""
        ...

    def cancel(self, msg_id: str | None, key: str | None) -> int | CancelAnswer:
        """Cancel by id or key everywhere; how many this engine cancelled, and where (CancelNotSentError if
        not sent)."""
        ...

    def find_messages(self, msg_id: str | None, key: str | None, limit: int) -> dict[str, Any]:
        """Stored messages with an id or a key, with their timelines (`timewheel.find.Found.to_dict`)."""
        ...

    def shaping_rules(self) -> dict[str, Any]:
        """The traffic rules in force."""
        ...

    def replace_shaping_rules(self, rules: dict[str, Any]) -> dict[str, Any]:
        """Validate and apply new rules (all or nothing); returns them."""
        ...

    def stats(self) -> dict[str, object]:
        """Engine and RocketMQ counters."""
        ...

    def status(self) -> dict[str, Any]:
        """The on-call summary (timewheel.app.status.status_document)."""
        ...


def _plain(value: object) -> object:
    """JSON for what json does not know: numpy scalars and arrays (counters), else their text."""
    tolist = getattr(value, "tolist", None)
    return tolist() if callable(tolist) else str(value)


class AdminServer:
    """The admin endpoint on `listen` (HOST:PORT), served by a bounded HTTP server."""

    def __init__(self, listen: str, token: str, target: AdminTarget, registry: CollectorRegistry,
                 limits: HttpLimits = HttpLimits()) -> None:
        host, _, port = listen.rpartition(":")
        self.token = token
        self.target = target
        self.registry = registry
        self._routes = {("GET", "/healthz"): self._healthz, ("GET", "/readyz"): self._readyz,
                        ("GET", "/metrics"): self._metrics, ("GET", "/shaping"): self._get_shaping,
                        ("GET", "/stats"): self._stats, ("GET", "/status"): self._status,
                        ("GET", "/messages"): self._messages, ("POST", "/cancel"): self._cancel,
                        ("PUT", "/shaping"): self._put_shaping}
        # a method no route takes is the server's 501, before any handler runs
        self.http = HttpServer(host.strip("[]"), int(port), self.handle, limits, name="timewheel-admin",
                               inline=lambda r: r.path in ("/healthz", "/readyz"),
                               methods=frozenset(m for m, _ in self._routes) | {"HEAD"}, screen=self._screen)
        self._status_lock = threading.Lock()  # one computation at a time; the others take its answer
        self._status_cached: tuple[float, dict[str, Any]] | None = None

    @property
    def address(self) -> str:
        """HOST:PORT actually bound (port 0 picks a free one)."""
        return self.http.address

    def start(self) -> "AdminServer":
        """Serve in a background thread."""
        self.http.start()
        log.info("admin endpoint on http://%s", self.address)
        return self

    def stop(self) -> None:
        """Stop serving."""
        self.http.stop()

    def authorized(self, header: str | None) -> int:
        """0 if the Authorization header carries the token, else the HTTP status to answer."""
        if not self.token:
            return 403
        scheme, _, credentials = (header or "").strip().partition(" ")
        if scheme.lower() != "bearer":  # auth schemes are case-insensitive (RFC 9110)
            return 401
        return 0 if hmac.compare_digest(credentials.strip().encode(), self.token.encode()) else 401

    def handle(self, req: Request) -> Response:
        """Route one request."""
        route = self._routes.get(_route_key(req))
        if route is not None:
            refused = self._screen(req)  # a guarded request with no body was not screened by the server
            return refused if refused is not None else route(req)
        allow = self.allowed_methods(req.path)
        if allow:
            # RFC 9110: a 405 must say what the path takes
            return _json(405, {"error": f"{req.method} is not allowed on {req.path}: it takes {', '.join(allow)}"},
                         {"Allow": ", ".join(allow)})
        # paths match exactly, never folded: a proxy in front may tell "//cancel" from "/cancel"
        meant = re.sub("/{2,}", "/", req.path)
        hint = f"; did you mean {meant}? (paths are matched exactly)" if self.allowed_methods(meant) else ""
        return _json(404, {"error": f"no such endpoint: {req.path}{hint}"})

    def allowed_methods(self, path: str) -> list[str]:
        """The methods `path` takes, sorted (HEAD wherever GET is); none for a path with no route."""
        methods = {m for m, p in self._routes if p == path}
        return sorted(methods | {"HEAD"} if "GET" in methods else methods)

    def _screen(self, req: Request) -> Response | None:
        """The refusal of a request to a guarded route without the token, from its head alone: the
        body of an unauthenticated request is never kept."""
        return self._guard(req) if _route_key(req) in _GUARDED else None

    def _guard(self, req: Request) -> Response | None:
        status = self.authorized(req.headers.get("authorization"))
        if not status:
            return None
        return _json(status, {"error": "no admin token is configured: mutations and message look-ups are disabled "
                                       "(set admin.token or TIMEWHEEL_ADMIN_TOKEN on the engine and restart it)" if status == 403
                              else "missing or wrong token: pass --token or set TIMEWHEEL_ADMIN_TOKEN (header "
                                   "Authorization: Bearer <token>)"})

    def _healthz(self, req: Request) -> Response:
        return _json(200, {"status": "ok"})

    def _readyz(self, req: Request) -> Response:
        why = self.target.not_ready_why()
        return _json(503 if why else 200, {"ready": not why, "why": why})

    def _metrics(self, req: Request) -> Response:
        return Response(200, generate_latest(self.registry), CONTENT_TYPE_LATEST)

    def _get_shaping(self, req: Request) -> Response:
        return _json(200, self.target.shaping_rules())

    def _stats(self, req: Request) -> Response:
        return _json(200, self.target.stats())

    def _status(self, req: Request) -> Response:
        with self._status_lock:
            cached = self._status_cached
            if cached is None or time.monotonic() - cached[0] >= STATUS_CACHE_S:
                cached = self._status_cached = (time.monotonic(), self.target.status())
        return _json(200, cached[1])

    def _messages(self, req: Request) -> Response:
        from timewheel.find import DEFAULT_LIMIT, MAX_LIMIT

        ids, keys, limits = req.query.get("id", []), req.query.get("key", []), req.query.get("limit", [])
        if len(ids) + len(keys) != 1 or not (ids or keys)[0]:
            return _json(400, {"error": "give exactly one non-empty ?id= or ?key="})
        text = limits[0] if limits else str(DEFAULT_LIMIT)
        limit = int(text) if text.isascii() and text.isdigit() else 0  # int() would take "+5", " 5", "1_0"
        if not 1 <= limit <= MAX_LIMIT or len(limits) > 1:
            return _json(400, {"error": f"limit must be one whole number from 1 to {MAX_LIMIT}"})
        try:
            return _json(200, self.target.find_messages(ids[0] if ids else None, keys[0] if keys else None, limit))
        except (ConfigError, EngineStateError) as e:  # not running, or stopping
            return _json(503, {"error": str(e)})
        except StorageError as e:  # this engine's storage failing (a corrupt meta store names its file and mend)
            return _json(503, {"error": str(e)})

    def _cancel(self, req: Request) -> Response:
        ids, keys = req.query.get("id", []), req.query.get("key", [])
        if len(ids) + len(keys) != 1 or not (ids or keys)[0]:
            return _json(400, {"error": "give exactly one non-empty ?id= or ?key="})
        from timewheel.app.cancel import CancelAnswer, CancelNotSentError

        try:
            got = self.target.cancel(ids[0] if ids else None, keys[0] if keys else None)
            # 200 either way: the cancel is on the delay topic; `promise` says whether the sender has it already
            return _json(200, (got if isinstance(got, CancelAnswer) else CancelAnswer(got)).to_dict())
        except (CancelNotSentError, EngineStateError, StorageWriteError, MetaStoreCorruptError) as e:
            # not applied (a full disk refused its record: what it did holds), or not everywhere: ask again;
            # a damaged meta store is this engine's storage failing too, and its words name the file and the mend
            return _json(503, {"error": str(e)})
        except ValueError as e:
            return _json(400, {"error": str(e)})

    def _put_shaping(self, req: Request) -> Response:
        try:
            rules = parse_json_object(req.body)
            return _json(200, self.target.replace_shaping_rules(rules))
        except EngineStateError as e:  # not the rules' fault: the same rules may be sent again
            return _json(503, {"error": str(e)})
        except (ValueError, ConfigError) as e:
            return _json(400, {"error": f"rules refused, the old ones stay in force: {e}"})


def parse_json_object(body: bytes) -> dict[str, Any]:
    """A JSON object from a request body; ValueError (naming the problem) for anything else.

    The body is at most 1 MiB (the HTTP server's limit); the parser's recursion limit bounds its
    nesting, and numbers too long to be a rate are refused by the rules' own validation.
    """
    if not body.strip():
        return {}
    try:
        doc = json.loads(body, parse_constant=_no_constant)
    except RecursionError as e:
        raise ValueError("the JSON nests deeper than the parser allows") from e
    if not isinstance(doc, dict):
        raise ValueError("the rules must be a JSON object")
    return doc


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number the rules accept")


def _route_key(req: Request) -> tuple[str, str]:
    """(method, path) as the routes are keyed: HEAD is GET without the body."""
    return req.method if req.method != "HEAD" else "GET", req.path


def _json(status: int, obj: Any, headers: Mapping[str, str] | None = None) -> Response:
    return Response(status, (json.dumps(obj, default=_plain) + "\n").encode(), headers=headers or {})


__all__ = ["AdminServer", "AdminTarget", "HttpError", "HttpLimits", "parse_json_object"]
