"""How the admin endpoint answers a request for a path it has under another method, or a path it has not."""
from __future__ import annotations

import http.client
import json
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from tests.timewheel.app.test_admin import TOKEN, _Target
from timewheel.app.admin import AdminServer


@pytest.fixture
def admin() -> Iterator[tuple[AdminServer, _Target]]:
    target = _Target()
    server = AdminServer("127.0.0.1:0", TOKEN, target, CollectorRegistry()).start()
    try:
        yield server, target
    finally:
        server.stop()


def _call(server: AdminServer, method: str, path: str,
          headers: dict[str, str] | None = None) -> tuple[int, http.client.HTTPMessage, dict[str, object]]:
    """Status, headers and JSON body of one request whose target is sent exactly as given."""
    host, port = server.address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request(method, path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.headers, json.loads(resp.read())
    finally:
        conn.close()


@pytest.mark.parametrize("method, path, allow", [
    ("POST", "/readyz", "GET, HEAD"),
    ("GET", "/cancel", "POST"),
    ("POST", "/shaping", "GET, HEAD, PUT"),
])
def test_a_method_a_path_does_not_take_is_answered_405_with_the_methods_it_does(
        admin: tuple[AdminServer, _Target], method: str, path: str, allow: str) -> None:
    server, target = admin
    status, headers, body = _call(server, method, path, {"Authorization": f"Bearer {TOKEN}"})
    assert (status, headers.get("Allow")) == (405, allow)
    assert allow in str(body["error"])
    assert target.cancels == [] and target.rules == {}


@pytest.mark.parametrize("method", ["PATCH", "FOO", "DELETE", "OPTIONS"])
@pytest.mark.parametrize("path", ["/shaping", "/cancel?id=x", "/no-such-path"])
def test_a_method_no_path_takes_is_answered_501_naming_it(admin: tuple[AdminServer, _Target], method: str,
                                                         path: str) -> None:
    """RFC 9110: a 405 says the path takes other methods; a method the endpoint takes nowhere is not
    implemented at all, whatever the path."""
    server, target = admin
    status, headers, body = _call(server, method, path, {"Authorization": f"Bearer {TOKEN}"})
    assert status == 501 and headers.get("Allow") is None, (status, body)
    assert f"method {method!r} is not implemented" in str(body["error"])
    assert target.cancels == [] and target.rules == {}


@pytest.mark.parametrize("path, hint", [("//readyz", "/readyz"), ("//cancel?id=x", "/cancel"),
                                        ("/metrics//", None)])
def test_a_doubled_slash_is_not_folded_and_its_404_names_the_path_as_sent(
        admin: tuple[AdminServer, _Target], path: str, hint: str | None) -> None:
    """Paths match exactly: folding slashes here would answer a path a proxy in front may have kept
    apart (an allow list of paths, say), so the answer names what came and what was likely meant."""
    server, target = admin
    for method in ("GET", "POST"):
        status, _, body = _call(server, method, path, {"Authorization": f"Bearer {TOKEN}"})
        sent = path.partition("?")[0]
        assert status == 404 and f"no such endpoint: {sent}" in str(body["error"])
        assert (f"did you mean {hint}?" in str(body["error"])) == (hint is not None)
    assert target.cancels == []
