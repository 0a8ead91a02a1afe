"""The `timewheel` command line: parses arguments and calls library functions."""
from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Optional, cast

import typer

from timewheel.app._cli_errors import fail as _fail, require_utf8 as _require_utf8
from timewheel.app.datadir import data_dir_option

# Help text is shown as written: rich markup would swallow every bracketed word ([ha], [rocketmq]).
app = typer.Typer(help="Arbitrary-delay messages for Apache RocketMQ.", no_args_is_help=True,
                  add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)

# existence is checked by open_data_dir, whose error says what to run; an empty one, by its parser
DataDir = Annotated[Path, typer.Option("--data-dir", parser=data_dir_option, metavar="<path>",
                                       help="The engine's data directory.")]


@app.callback()
def _root() -> None:
    """Arbitrary-delay messages for Apache RocketMQ."""


@app.command()
def init(data_dir: DataDir,
         segment_minutes: Annotated[Optional[int], typer.Option("--segment-minutes", help="Minutes per segment "
                                                                "(must divide a day; default 60, the engine's).")]
         = None) -> None:
    """Make an empty data directory for the engine, backfill and the audit (nothing if one is there)."""
    from timewheel.app.datadir import DataDirError, init_data_dir

    try:
        layout, made = init_data_dir(data_dir, segment_minutes)
    except DataDirError as e:
        _fail(str(e))
    what = "made" if made else "already"
    typer.echo(f"{what} a timewheel data directory: {data_dir} (segments of {layout.segment_minutes} minutes); "
               f"next: `timewheel serve --data-dir {data_dir} --namesrv HOST:PORT` or "
               f"`timewheel backfill INPUT --data-dir {data_dir}`")


@app.command()
def inspect(data_dir: DataDir,
            as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
            verify: Annotated[bool, typer.Option("--verify", help="Also check every record's CRC32C, and read "
                                                 "the meta store through.")] = False,
            fix: Annotated[bool, typer.Option("--fix", help="--verify, and repair what it finds that can be: torn "
                                              "tails no running engine holds, a sidecar's copy a crash left, an origin "
                                              "sidecar short of its index; corrupt records are marked CORRUPT in the "
                                              "dispatch log, never served.")] = False
            ) -> None:
    """Per segment: records, dispatched, cancelled, dead-lettered, pending, bytes, corrupt; then totals.

    Reads the files only, so it is safe beside a running engine. With --verify, a file whose end
    is being written while it is read is not reported as torn: it is counted as in flight. A file
    that cannot be read is a finding, and the rest is counted. --fix repairs only files that stand
    still and that no engine holds (a part a running engine writes is left, counted as in flight), so
    it too is safe beside one. Exits 1 when it finds damage (repaired or not), 2 when the data
    directory cannot be opened.
    """
    from storage import check, summarize
    from timewheel.app.datadir import DataDirError, open_data_dir, read_error
    from timewheel.app.progress import segment_progress

    try:
        layout = open_data_dir(data_dir)
        with segment_progress("reading segments") as progress:
            report = summarize(layout, progress=progress)
        verify = verify or fix
        if verify:
            with segment_progress("repairing" if fix else "checking every record") as progress:
                rep = check(layout, fix=fix, now_ms=int(time.time() * 1000), progress=progress)
    except DataDirError as e:
        _fail(str(e))
    except OSError as e:
        _fail(read_error(data_dir, e))
    in_flight = 0
    if verify:  # the check reads every file the summary did, and reports what it could not read too
        report["findings"] = [{"kind": f.kind, "path": f.path, "detail": f.detail} for f in rep.findings]
        report["tails_in_flight"] = in_flight = rep.tails_in_flight
        if fix:
            report["fixed"] = rep.fixed
    findings = cast("list[dict[str, str]]", report["findings"])
    if as_json:
        typer.echo(json.dumps(report))
        raise typer.Exit(1 if findings else 0)
    from rich.console import Console
    from rich.table import Table

    from timewheel.app.humantime import human_time

    cols = ("records", "dispatched", "cancelled", "dead_lettered", "pending", "corrupt", "bytes")
    table = Table(title=f"timewheel data in {data_dir}")
    table.add_column("segment", no_wrap=True)
    for c in cols:
        table.add_column(c.replace("_", " "), justify="right")
    segments = cast("list[dict[str, int]]", report["segments"])
    for s in segments:
        table.add_row(human_time(s["start_ms"]), *(f"{s[c]:,}" for c in cols))
    totals = cast("dict[str, int]", report["totals"])
    table.add_row("total", *(f"{totals[c]:,}" for c in cols), style="bold")
    console = Console()
    console.print(table)
    for f in findings:
        console.print(f"[red]{f['kind']}[/red] {f['path']}: {f['detail']}")
    if in_flight:
        console.print(f"{in_flight} file(s) were being written while read (a running engine): their last "
                      "bytes are not judged" + (", nor repaired" if fix else ""))
    if fix and findings:
        console.print(f"{rep.fixed} repair(s) made; `timewheel inspect --verify` shows what remains")
    if findings:  # damage is bad news, as the audit's findings are
        raise typer.Exit(1)


@app.command()
def broker(dir: Annotated[Optional[Path], typer.Option("--dir", help="Keep the store and logs here "
                                                       "(default: a temporary directory).")] = None,
           acl: Annotated[Optional[str], typer.Option(
               "--acl", metavar="ACCESS_KEY:SECRET_KEY",
               help="Turn authentication and authorization on, with this user as the administrator; point the "
                    "engine at it with [rocketmq] access_key and secret_key.")] = None,
           tls: Annotated[bool, typer.Option(
               "--tls", help="Accept TLS connections only (a self-signed certificate made in the run directory); "
                             "prints how to point the engine at it ([rocketmq] tls = true and tls_ca_file).")] = False,
           version: Annotated[Optional[str], typer.Option(
               "--version", metavar="X.Y.Z", help="The Apache RocketMQ release to run (default: the one the "
                                                  "tests run; 4.9.7 is the newest 4.x on Maven Central).")] = None
           ) -> None:
    """Run a local RocketMQ (NameServer + Broker from Maven Central jars) in the foreground.

    Prints `namesrv 127.0.0.1:PORT` once it is ready; Ctrl-C stops it.
    """
    from forwarder import LocalRocketMQError
    from forwarder.local_rocketmq import run_foreground
    from forwarder.rocketmq import Credentials

    user = None
    if acl is not None:
        access_key, sep, secret_key = acl.partition(":")
        if not sep or not access_key or not secret_key:
            _fail("--acl takes ACCESS_KEY:SECRET_KEY, both non-empty (for example --acl admin:s3cret-key)")
        user = Credentials(access_key, secret_key)
    try:
        run_foreground(dir, acl=user, tls=tls, version=version)
    except LocalRocketMQError as e:
        _fail(str(e))


@app.command()
def zookeeper(dir: Annotated[Optional[Path], typer.Option("--dir", help="Keep the data and logs here "
                                                          "(default: a temporary directory).")] = None) -> None:
    """Run a local ZooKeeper (from Maven Central jars) in the foreground, for replica sets ([ha]).

    Prints `zookeeper 127.0.0.1:PORT` once it answers; Ctrl-C stops it.
    """
    from coordination import LocalZooKeeperError
    from coordination.local_zookeeper import run_foreground

    try:
        run_foreground(dir)
    except LocalZooKeeperError as e:
        _fail(str(e))


# --data-dir is text, not a Path: typer would read an empty one (an unset variable) as ".", the working directory
@app.command()
def serve(data_dir: Annotated[Optional[str], typer.Option("--data-dir", metavar="<path>",
                                                          help="Data directory (engine.data_dir).")] = None,
          namesrv: Annotated[Optional[str], typer.Option(help="NameServer address (rocketmq.namesrv).")] = None,
          config: Annotated[Optional[Path], typer.Option("--config", help="TOML config file.")] = None,
          print_config: Annotated[bool, typer.Option("--print-config", help="Print the effective config "
                                                     "(secrets redacted) and exit.")] = False,
          admin: Annotated[Optional[str], typer.Option("--admin", help="Admin HTTP HOST:PORT "
                                                       "(default 127.0.0.1:9321).")] = None,
          log_format: Annotated[Optional[str], typer.Option("--log-format", help="text or json.")] = None,
          force_lease: Annotated[bool, typer.Option(
              "--force-lease", help="With [ha]: contend for the shard's lease even though this data directory "
              "has a gap (offsets the broker moved past, a wiped or restored directory) or has not caught up "
              "(ha.force_eligible). As holder it cannot send what it never stored: messages it missed are "
              "lost if the other replicas are gone.")] = False) -> None:
    """Run the engine: consume the delay topic, store, and deliver each message when due.

    Configuration: the TOML file, then TIMEWHEEL_* environment variables, then these flags.
    """
    from storage import MetaStoreCorruptError
    from timewheel.errors import ConfigError
    from timewheel.app.logs import setup_logging
    from timewheel.app.service import Service, StartError
    from timewheel.app.settings import load_settings

    overrides: dict[str, dict[str, object]] = {"engine": {"data_dir": data_dir}, "rocketmq": {"namesrv": namesrv},
                                               "log": {"format": log_format}, "admin": {"listen": admin},
                                               "ha": {"force_eligible": True if force_lease else None}}
    try:
        settings = load_settings(config, None, overrides)
    except ConfigError as e:
        _fail(str(e))
    if print_config:
        typer.echo(json.dumps(settings.redacted(), indent=2))
        return
    setup_logging(settings.log.format, settings.log.level)
    try:
        Service(settings, config_path=config).run_until_signalled()
    # the start has stopped what it started before raising; a ConfigError here is a file the settings
    # name that changed since they were loaded, a MetaStoreCorruptError met after the engine started
    except (StartError, ConfigError, MetaStoreCorruptError) as e:
        _fail(str(e))


@app.command()
def cancel(msg_id: Annotated[Optional[str], typer.Option("--id", help="Message id to cancel.")] = None,
           key: Annotated[Optional[str], typer.Option("--key", help="Cancel every message under this business key.")]
           = None,
           admin: Annotated[str, typer.Option("--admin", help="The engine's admin HOST:PORT.")] = "127.0.0.1:9321",
           token: Annotated[Optional[str], typer.Option("--token", envvar="TIMEWHEEL_ADMIN_TOKEN",
                                                        help="Admin token (or TIMEWHEEL_ADMIN_TOKEN).")] = None
           ) -> None:
    """Cancel a delayed message by id, or all under a business key, on every engine of the delay topic.

    The engine behind the admin API puts the cancel on each queue of the delay topic (so every
    replica of every shard applies it, also to messages that arrive after it) and applies it itself.
    """
    import http.client
    import urllib.error
    import urllib.parse
    import urllib.request

    from timewheel.cancels import CancelRequest

    if (msg_id is None) == (key is None):
        _fail("give exactly one of --id or --key")
    _require_utf8("--id" if key is None else "--key", msg_id if key is None else key)
    try:  # the rule every engine applies to a cancel: refused here without a round trip
        CancelRequest(msg_id, key, 0)
    except ValueError as e:
        _fail(str(e))
    q = urllib.parse.urlencode({"id": msg_id} if msg_id is not None else {"key": key})
    try:
        req = urllib.request.Request(f"http://{admin}/cancel?{q}", method="POST",
                                     headers={"Authorization": f"Bearer {token or ''}"})
    except ValueError as e:
        _fail(f"--admin {admin!r} is not HOST:PORT ({e})")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            answer = json.loads(resp.read())
            typer.echo(f"cancelled {answer['cancelled']} here; the cancel is on every queue of the delay topic for "
                       "the other engines")
            if answer.get("promise") is False:  # answered by a standby replica
                typer.echo(f"warning: {answer.get('note', 'applied on a standby replica only')}", err=True)
    except urllib.error.HTTPError as e:
        if e.code == 431:  # the id or key does not fit the admin API's request head
            _fail(f"the {'id' if key is None else 'key'} is too long for the admin API (HTTP 431: "
                  f"{e.read().decode(errors='replace').strip()}): send the cancel as a control message on the delay "
                  f"topic instead ({'TW_CANCEL_ID' if key is None else 'TW_CANCEL_KEY'}, on every queue; see README)")
        _fail(f"the engine refused: HTTP {e.code}: {e.read().decode(errors='replace').strip()}")
    except urllib.error.URLError as e:
        from timewheel.app.status import unreachable

        _fail(unreachable(admin, e.reason))
    except (http.client.InvalidURL, ValueError) as e:
        _fail(f"--admin {admin!r} is not HOST:PORT ({e})")


@app.command()
def status(admin: Annotated[str, typer.Option("--admin", help="The engine's admin HOST:PORT.")] = "127.0.0.1:9321",
           as_json: Annotated[bool, typer.Option("--json", help="Print the admin endpoint's /status JSON "
                                                 "(times in epoch ms).")] = False) -> None:
    """One screen for on call: ingest lag per queue, pending per segment, ready, retrying, dead-lettered,
    lateness p50/p99 over the last minute, and traffic shaping.

    Exits 1 when the engine is not serving.
    """
    from rich.console import Console

    from timewheel.app.status import StatusError, fetch_status, render_status

    try:
        doc = fetch_status(admin)
    except StatusError as e:
        _fail(str(e))
    if as_json:
        typer.echo(json.dumps(doc))
    else:
        Console().print(render_status(doc, admin))
    if not doc.get("serving"):
        raise typer.Exit(1)


@app.command()
def demo(duration: Annotated[float, typer.Option(help="Seconds of producing (above 0).")] = 30.0,
         rate: Annotated[int, typer.Option(help="Messages per second (at least 1).")] = 200,
         as_json: Annotated[bool, typer.Option("--json", help="End with the summary as one JSON line on stdout.")]
         = False) -> None:
    """Start a local RocketMQ, the engine, a producer and a consumer; show live lateness; summarize."""
    from forwarder import LocalRocketMQError
    from timewheel.app.demo import DemoError, run_demo

    try:
        summary = run_demo(duration, rate, as_json)
    except (LocalRocketMQError, DemoError) as e:
        _fail(str(e))
    # Everything is stopped and printed. Leave without running the RocketMQ client library's static
    # destructors, which can abort while its threads wind down (as `serve` does).
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(1 if summary["lost"] else 0)


def _register_spark_commands() -> None:
    from timewheel.app import cli_spark  # imports pyspark lazily, inside each command

    cli_spark.register(app)


_register_spark_commands()


def _register_send_command() -> None:
    from timewheel.app import cli_send

    cli_send.register(app)


_register_send_command()


def _register_find_command() -> None:
    from timewheel.app import cli_find

    cli_find.register(app)


_register_find_command()


def main() -> None:
    """Entry point of the console script."""
    app()


if __name__ == "__main__":
    main()
    sys.exit(0)
