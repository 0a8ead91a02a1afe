"""`timewheel send` when no NameServer answers: a clear error that says what to check, in seconds."""
from __future__ import annotations

import socket
import time

from typer.testing import CliRunner

from timewheel.app.cli import app


def test_a_send_without_a_name_server_fails_saying_what_to_check() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        namesrv = f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once closed
    start = time.monotonic()
    res = CliRunner().invoke(app, ["send", "--namesrv", namesrv, "--topic", "ORDERS", "--delay", "30s",
                                   "--body", "hello"])
    took = time.monotonic() - start
    assert res.exit_code == 2, res.output
    assert "timewheel: send failed: send to TW_DELAY failed (tried 4 times)" in res.output, res.output
    assert f"is a NameServer at {namesrv}" in res.output and "can this host reach them?" in res.output, res.output
    assert "sent " not in res.output
    assert took < 30, f"a send with nothing to send to took {took:.1f} s to fail"
