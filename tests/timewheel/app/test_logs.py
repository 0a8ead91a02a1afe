"""The CLI's logging setup."""
from __future__ import annotations

import logging

from timewheel.app.logs import JsonFormatter, setup_logging


def test_cli_logging_setup_replaces_its_own_handler_and_keeps_others() -> None:
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    other = logging.NullHandler()
    root.addHandler(other)
    try:
        setup_logging("json", "WARNING")
        setup_logging("text", "INFO")
        mine = [h for h in root.handlers if type(h).__name__ == "_CliHandler"]
        assert len(mine) == 1 and other in root.handlers and root.level == logging.INFO
        assert isinstance(mine[0].formatter, logging.Formatter) and not isinstance(mine[0].formatter, JsonFormatter)
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
