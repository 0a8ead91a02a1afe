"""A `Service` holding only what its readiness reads, for tests of readiness without a broker."""
from __future__ import annotations

from typing import Any

from timewheel.app.service import Service


def readiness_only(engine: Any, replica: Any = None, consuming: bool = True) -> Service:
    """A Service, not started, with `engine` (a real one or a fake with its readiness methods), the
    delay topic consumed or not, a replica or none and no RocketMQ endpoints: what `ready()`,
    `not_ready_why()` and `dead_threads()` read, set here in one place."""
    svc = Service.__new__(Service)
    svc.engine, svc._consuming, svc.replica, svc._endpoints = engine, consuming, replica, None
    svc.clock_guard = None  # the clock check holds nothing here
    return svc
