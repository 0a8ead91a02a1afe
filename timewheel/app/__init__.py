"""The application around the engine: CLI, service, admin HTTP, metrics, settings, logging, demo.

It wires the core (`timewheel`), `forwarder` and `spark` together; nothing in the core imports it.
Its public names load lazily, so `timewheel --help` does not load the RocketMQ client or Spark.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"Service": "service", "Settings": "settings", "AdminConfig": "settings", "LogConfig": "settings",
            "load_settings": "settings", "main": "cli"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """Import a public name from its module on first use."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'timewheel.app' has no attribute {name!r}")
    return getattr(importlib.import_module(f"timewheel.app.{_EXPORTS[name]}"), name)
