"""Waiting on real processes and brokers: poll a condition instead of sleeping a fixed time."""
from __future__ import annotations

import json
import time
import urllib.request
import uuid
from typing import Callable


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0, interval: float = 0.05) -> bool:
    """Poll `predicate` until it is true or `timeout` seconds pass; its last answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def unique(prefix: str) -> str:
    """A topic or group name no other test uses (the session shares one broker)."""
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


def admin_ready(port: int) -> bool:
    """Whether the `timewheel serve` admin API on loopback `port` answers ready (False while it does
    not answer, or answers not ready: /readyz is 503 then)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as r:
            return bool(json.loads(r.read())["ready"])
    except (OSError, ValueError, KeyError):
        return False
