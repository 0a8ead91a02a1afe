"""The `timewheel` command line: parses arguments and calls library functions."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(help="Arbitrary-delay messages for Apache RocketMQ.", no_args_is_help=True,
                  add_completion=False, pretty_exceptions_enable=False)

DataDir = Annotated[Path, typer.Option("--data-dir", help="The engine's data directory.", exists=True,
                                       file_okay=False, dir_okay=True)]


@app.callback()
def _root() -> None:
    """Arbitrary-delay messages for Apache RocketMQ."""


def _fail(msg: str, code: int = 2) -> None:
    typer.echo(f"timewheel: {msg}", err=True)
    raise typer.Exit(code)


@app.command()
def inspect(data_dir: DataDir,
            as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
            verify: Annotated[bool, typer.Option("--verify", help="Also check every record's CRC32C.")] = False
            ) -> None:
    """Per segment: records, dispatched, cancelled, dead-lettered, pending, bytes, corrupt; then totals.

    Reads the files only, so it is safe beside a running engine.
    """
    from storage import SegmentLayout, StorageError, check, summarize

    try:
        layout = SegmentLayout.open_existing(data_dir)
    except StorageError as e:
        _fail(str(e))
    report = summarize(layout)
    findings = []
    if verify:
        rep = check(layout)
        findings = [{"kind": f.kind, "path": f.path, "detail": f.detail} for f in rep.findings]
        report["findings"] = findings
    if as_json:
        typer.echo(json.dumps(report))
        return
    from rich.console import Console
    from rich.table import Table

    cols = ("records", "dispatched", "cancelled", "dead_lettered", "pending", "corrupt", "bytes")
    table = Table(title=f"timewheel data in {data_dir}")
    table.add_column("segment")
    for c in cols:
        table.add_column(c, justify="right")
    for s in report["segments"]:
        table.add_row(s["segment"], *(f"{s[c]:,}" for c in cols))
    totals = report["totals"]
    table.add_row("total", *(f"{totals[c]:,}" for c in cols), style="bold")
    console = Console()
    console.print(table)
    for f in findings:
        console.print(f"[red]{f['kind']}[/red] {f['path']}: {f['detail']}")


def main() -> None:
    """Entry point of the console script."""
    app()


if __name__ == "__main__":
    main()
    sys.exit(0)
