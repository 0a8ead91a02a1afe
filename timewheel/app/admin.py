"""The admin HTTP endpoint: health, readiness, Prometheus metrics, and token-guarded mutations.

    GET  /healthz                 200 while the process serves requests
    GET  /readyz                  200 once the engine runs and consumes, else 503
    GET  /metrics                 Prometheus text
    GET  /stats                   the engine's and RocketMQ's counters (JSON, epoch ms)
    GET  /status                  one screen for on call: ingest lag, pending, lateness (JSON, epoch ms)
    POST /cancel?id=ID | ?key=K   cancel; needs "Authorization: Bearer <token>"
    GET  /shaping                 the traffic rules in force (JSON)
    PUT  /shaping                 replace the rules (JSON body); needs the token

Mutations are refused with 403 when no token is configured, 401 when the request's is wrong.
It listens on loopback unless configured otherwise.
"""
from __future__ import annotations

import hmac
import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from timewheel.errors import ConfigError

log = logging.getLogger("timewheel.app.admin")


class AdminTarget(Protocol):
    """What the admin endpoint drives (the Service)."""

    def ready(self) -> bool:
        """Whether the engine runs and consumes."""
        ...

    def cancel(self, msg_id: str | None, key: str | None) -> int:
        """Cancel by id or key; how many were cancelled."""
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
    """A small threaded HTTP server bound to `listen` (HOST:PORT)."""

    def __init__(self, listen: str, token: str, target: AdminTarget, registry: CollectorRegistry) -> None:
        host, _, port = listen.rpartition(":")
        self.token = token
        self.target = target
        self.registry = registry
        handler = _handler_class(self)
        self.httpd = ThreadingHTTPServer((host.strip("[]"), int(port)), handler)
        self.httpd.daemon_threads = True
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="timewheel-admin", daemon=True)

    @property
    def address(self) -> str:
        """HOST:PORT actually bound (port 0 picks a free one)."""
        host, port = self.httpd.server_address[:2]
        return f"{host}:{port}"

    def start(self) -> "AdminServer":
        """Serve in a background thread."""
        self._thread.start()
        log.info("admin endpoint on http://%s", self.address)
        return self

    def stop(self) -> None:
        """Stop serving."""
        self.httpd.shutdown()
        self.httpd.server_close()

    def authorized(self, header: str | None) -> int:
        """0 if the Authorization header carries the token, else the HTTP status to answer."""
        if not self.token:
            return 403
        if not header or not header.startswith("Bearer "):
            return 401
        return 0 if hmac.compare_digest(header[7:].strip().encode(), self.token.encode()) else 401


def _handler_class(server: AdminServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("admin %s", fmt % args)

        def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _json(self, status: int, obj: Any) -> None:
            self._send(status, (json.dumps(obj, default=_plain) + "\n").encode())

        def _guard(self) -> bool:
            status = server.authorized(self.headers.get("Authorization"))
            if status:
                self._json(status, {"error": "no admin token is configured: mutations are disabled (set admin.token "
                                             "or TIMEWHEEL_ADMIN_TOKEN on the engine and restart it)"
                                    if status == 403 else "missing or wrong token: pass --token or set "
                                    "TIMEWHEEL_ADMIN_TOKEN (header Authorization: Bearer <token>)"})
                return False
            return True

        def do_GET(self) -> None:  # noqa: N802
            path = urlsplit(self.path).path
            if path == "/healthz":
                self._json(200, {"status": "ok"})
            elif path == "/readyz":
                ok = server.target.ready()
                self._json(200 if ok else 503, {"ready": ok})
            elif path == "/metrics":
                self._send(200, generate_latest(server.registry), CONTENT_TYPE_LATEST)
            elif path == "/shaping":
                self._json(200, server.target.shaping_rules())
            elif path == "/stats":
                self._json(200, server.target.stats())
            elif path == "/status":
                self._json(200, server.target.status())
            else:
                self._json(404, {"error": f"no such endpoint: {path}"})

        def do_POST(self) -> None:  # noqa: N802
            parts = urlsplit(self.path)
            self._drain_body()
            if parts.path != "/cancel":
                self._json(404, {"error": f"no such endpoint: {parts.path}"})
                return
            if not self._guard():
                return
            q = parse_qs(parts.query)
            ids, keys = q.get("id", []), q.get("key", [])
            if len(ids) + len(keys) != 1:
                self._json(400, {"error": "give exactly one of ?id= or ?key="})
                return
            n = server.target.cancel(ids[0] if ids else None, keys[0] if keys else None)
            self._json(200, {"cancelled": n})

        def do_PUT(self) -> None:  # noqa: N802
            parts = urlsplit(self.path)
            body = self._drain_body()
            if parts.path != "/shaping":
                self._json(404, {"error": f"no such endpoint: {parts.path}"})
                return
            if not self._guard():
                return
            try:
                rules = json.loads(body or b"{}")
                if not isinstance(rules, dict):
                    raise ConfigError("the rules must be a JSON object")
                self._json(200, server.target.replace_shaping_rules(rules))
            except (ValueError, ConfigError) as e:
                self._json(400, {"error": f"rules refused, the old ones stay in force: {e}"})

        def _drain_body(self) -> bytes:
            n = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(min(n, 1 << 20)) if n else b""

    return Handler

