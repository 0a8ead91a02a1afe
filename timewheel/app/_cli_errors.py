"""How every `timewheel` command says what is wrong: one line on stderr, then its exit code."""
from __future__ import annotations

from typing import NoReturn, Optional

import typer


def fail(msg: str, code: int = 2) -> NoReturn:
    """Print `timewheel: msg` on stderr and exit with `code` (2: a usage or input error)."""
    typer.echo(f"timewheel: {msg}", err=True)
    raise typer.Exit(code)


def require_utf8(option: str, text: Optional[str]) -> None:
    """Fail unless `text` is UTF-8 (Python reads argv bytes that are not as lone surrogates)."""
    if text is not None:
        try:
            text.encode()
        except UnicodeEncodeError:
            fail(f"{option} {text!r:.80} is not valid UTF-8 (no RocketMQ message can carry it): give it as UTF-8 text")
