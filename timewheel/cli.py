"""The `timewheel` command line: parses arguments and calls library functions."""
from __future__ import annotations

import typer

app = typer.Typer(help="Arbitrary-delay messages for Apache RocketMQ.", no_args_is_help=True, add_completion=False)


@app.callback()
def _root() -> None:
    """Arbitrary-delay messages for Apache RocketMQ."""


def main() -> None:
    """Entry point of the console script."""
    app()
