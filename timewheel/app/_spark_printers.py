"""How the Spark commands of the `timewheel` CLI print their results: tables for people, JSON for programs.

The `spark` package is imported inside the functions (and named for type checkers only): the CLI
starts without loading PySpark until a Spark command runs.
"""
from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from spark.audit import AuditReport
    from spark.backfill import BackfillResult
    from spark.export import ExportResult
    from spark.replay import ReplayResult


def print_json(obj: object) -> None:
    """One JSON object on stdout."""
    sys.stdout.write(json.dumps(obj, default=str) + "\n")
    sys.stdout.flush()


def print_backfill(result: BackfillResult) -> None:
    """What a backfill scheduled and rejected, as a table."""
    from rich.console import Console
    from rich.table import Table

    from spark.backfill import REASONS

    out = result.as_dict()
    console = Console()
    table = Table(title=f"backfill {result.job}", show_header=False)
    for k in ("input_rows", "scheduled", "already_scheduled", "duplicates", "rejected", "segments"):
        table.add_row(k.replace("_", " "), f"{out[k]:,}")
    console.print(table)
    for reason, n in sorted(result.rejected_by_reason.items()):
        console.print(f"[red]rejected[/red] {n:,}: {REASONS.get(reason, reason)}")
    if result.rejected:
        console.print(f"rejected rows with their reason: {result.rejects_path}")


def print_audit(rep: AuditReport) -> None:
    """The audit report as tables."""
    from rich.console import Console
    from rich.table import Table

    from timewheel.app.humantime import human_time

    console = Console()
    cols = ("scheduled", "dispatched", "cancelled", "dead_lettered", "corrupt", "pending", "lost", "replayed",
            "duplicates")
    table = Table(title="timewheel audit")
    table.add_column("segment", no_wrap=True)
    table.add_column("topic")
    for c in cols:
        table.add_column(c.replace("_", " "), justify="right")
    for s in rep.segments:
        table.add_row(human_time(s["segment_ms"]), s["topic"] or "(corrupt)", *(f"{s[c]:,}" for c in cols))
    totals = rep.as_dict()
    table.add_row("total", "", *(f"{totals[c]:,}" for c in cols), style="bold")
    console.print(table)
    late = rep.lateness_ms
    if late.get("delivered"):
        console.print(f"lateness (ms): p50 {late['p50_ms']}, p99 {late['p99_ms']}, max {late['max_ms']} "
                      f"over {late['delivered']:,} deliveries")
    for kind, n in (("lost", rep.lost), ("duplicated", rep.duplicates), ("corrupt", rep.corrupt),
                    ("unreadable records", rep.unreadable_records),
                    ("unknown dispatch entries", rep.unknown_dispatch_entries)):
        if n:
            console.print(f"[red]{kind}[/red]: {n:,}")
    for copy in rep.leftover_copies[:20]:
        console.print(f"[yellow]leftover copy[/yellow] {copy['path']}: {copy['plan']} "
                      "(`timewheel inspect --fix` settles it)")
    for f in rep.sample_findings[:20]:
        console.print(f"  {f['kind']} segment {human_time(f['segment_ms'])} part {f['part']} offset {f['offset']} "
                      f"{f['msg_id'] or ''} {f['topic'] or ''}: {f['detail']}")
    if rep.findings_path:
        console.print(f"findings: {rep.findings_path}")
    if rep.chart_path:
        console.print(f"lateness chart: {rep.chart_path}")
    console.print("[green]ok[/green]" if not rep.failed else "[red]FAILED[/red]: see the findings above")


def print_replay(result: ReplayResult) -> None:
    """What a replay did, or would do."""
    from rich.console import Console
    from rich.table import Table

    from timewheel.app.humantime import human_time

    console = Console()
    span = f"due in [{human_time(result.since_ms)}, {human_time(result.until_ms)})" + (
        f", topic {result.topic}" if result.topic else "")
    if result.dry_run:
        console.print(f"dry run: would send {result.matched - result.skipped_corrupt:,} messages {span}; "
                      "nothing sent, nothing recorded")
        for t, n in sorted(result.by_topic.items()):
            console.print(f"  {t}: {n:,}")
        if result.sample:
            table = Table(title=f"first {len(result.sample)} by due time")
            for c in ("due", "topic", "msg_id", "tags", "keys", "body bytes"):
                table.add_column(c)
            for r in result.sample:
                table.add_row(human_time(r["due_ms"]), r["topic"], r["msg_id"], r["tags"] or "",
                              " ".join(r["keys"] or ()), str(r["body_bytes"]))
            console.print(table)
    else:
        for note in result.notes:
            console.print(f"[yellow]repaired[/yellow]: {note}")
        console.print(f"replayed {result.sent:,} messages {span}" + (f"; {result.failed:,} failed" if result.failed
                                                                     else ""))
        for e in result.errors[:5]:
            console.print(f"[red]error[/red]: {e}")
    if result.skipped_corrupt:
        console.print(f"[red]skipped[/red] {result.skipped_corrupt:,} corrupt records (run the audit)")
    if result.unreadable_records:
        console.print(f"[red]unreadable[/red]: {result.unreadable_records:,} record(s) cannot be read (named below)")


def print_export(result: ExportResult) -> None:
    """Where an export wrote what, in one line."""
    typer.echo(f"exported {result.records:,} records to {result.records_path}"
               + (f" and {result.dispatch_entries:,} dispatch entries to {result.dispatch_path}"
                  if result.dispatch_path else ""))
