"""Logging setup: plain text, or one JSON object a line."""
from __future__ import annotations

import json
import logging
import time


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts, level, logger, msg, and the exception if any."""

    def format(self, record: logging.LogRecord) -> str:
        """Render a record as JSON."""
        out = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
               "level": record.levelname, "logger": record.name, "msg": record.getMessage()}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


class _CliHandler(logging.StreamHandler):  # type: ignore[type-arg,unused-ignore]
    """The handler setup_logging installs: calling it again replaces this one only."""


def setup_logging(fmt: str = "text", level: str = "INFO") -> None:
    """Configure the root logger for the CLI (handlers others installed, e.g. a test runner's, stay)."""
    handler = _CliHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [h for h in root.handlers if not isinstance(h, _CliHandler)] + [handler]
    root.setLevel(level.upper())
