"""The Spark commands of the `timewheel` CLI: backfill, audit, replay, export.

`register(app)` adds them to the main Typer app. Each parses its arguments, opens a SparkSession on
`--master` (`local[*]` by default) and calls one function of the `spark` package.
"""
from __future__ import annotations

import math
import time
import warnings
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Iterator, Optional, Sequence

import typer

from timewheel.app._cli_errors import fail as _fail
from timewheel.app._spark_interrupt import interruptible, start_off_main_thread
from timewheel.app.datadir import data_dir_option
from timewheel.app._spark_printers import print_audit, print_backfill, print_export, print_json, print_replay
from timewheel.config import EngineConfig

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

_ENGINE_DEFAULTS: dict[str, int] = {f: EngineConfig.__dataclass_fields__[f].default  # type: ignore[misc]
                                    for f in ("max_delay_ms", "max_body_bytes")}

# existence is checked by _open_layout, whose error says what to run
DataDir = Annotated[Path, typer.Option("--data-dir", parser=data_dir_option, metavar="<path>",
                                       help="The engine's data directory (holds timewheel.json; `timewheel init` "
                                            "makes one).")]
Master = Annotated[str, typer.Option("--master", help="Spark master URL: local[*], local[4], spark://host:7077, "
                                                      "yarn, ...")]
Conf = Annotated[Optional[list[str]], typer.Option("--conf", help="Extra Spark setting KEY=VALUE (repeatable).",
                                                   metavar="KEY=VALUE")]
Verbose = Annotated[bool, typer.Option("--verbose", help="Keep Spark's own log lines (warnings) on stderr.")]
AsJson = Annotated[bool, typer.Option("--json", help="Print the result as one JSON object on stdout.")]


class InputFormat(str, Enum):
    """Backfill input formats."""

    parquet = "parquet"
    json = "json"
    csv = "csv"


class PastDue(str, Enum):
    """What a backfill does with rows due in a segment already past."""

    reject = "reject"
    now = "now"


def _time_ms(value: str, flag: str) -> int:
    """Epoch ms of a time argument, or a usage error naming the flag."""
    from spark._util import parse_time_ms

    try:
        return parse_time_ms(value)
    except ValueError as e:
        _fail(f"{flag}: {e}")
        raise  # unreachable: _fail exits


def _quiet_log4j() -> Path:
    """Spark's log4j2 settings for the CLI (errors only), kept beside the `spark` package's modules."""
    import spark

    return Path(spark.__file__).resolve().parent / "log4j2-quiet.properties"


@contextmanager
def _spark(master: str, conf: list[str] | None, verbose: bool, *, undone: str = "the command did not finish",
           light_jvm: bool = False) -> Iterator["SparkSession"]:
    """A session on `master` (or the one already active in this process), stopped after the
    command when the command started it; `light_jvm` as `spark.session.get_session` takes it.
    A Ctrl-C stops a session it started, and the command: `timewheel: interrupted: {undone}`, exit 130."""
    warnings.filterwarnings("ignore", message="PySpark does not yet fully support pandas", category=FutureWarning)
    from pyspark.sql import SparkSession

    from spark.session import get_session

    extra: dict[str, str] = {}
    for item in conf or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            _fail(f"--conf {item!r}: expected KEY=VALUE")
        extra[key.strip()] = value.strip()
    if not verbose:
        log4j = _quiet_log4j()
        if log4j.exists():
            opt = f"-Dlog4j2.configurationFile=file:{log4j}"
            extra.setdefault("spark.driver.extraJavaOptions", opt)
            extra.setdefault("spark.executor.extraJavaOptions", opt)
    active = SparkSession.getActiveSession()
    if active is not None:  # called from a program that has its session already: use it as it is
        from spark.session import register_sources

        register_sources(active)
        yield active
        return
    with interruptible(undone) as interrupts:
        spark = start_off_main_thread(lambda: get_session(master, "timewheel-cli", extra, light_jvm=light_jvm))
        interrupts.started(spark)
        if not verbose:
            spark.sparkContext.setLogLevel("ERROR")
        try:
            yield spark
        finally:
            spark.stop()


def _require_finite(value: float, flag: str) -> None:
    """Fail unless `value` is a finite number (a range check lets infinity through)."""
    if not math.isfinite(value):
        _fail(f"{flag} must be a finite number, not {value}")


def _open_layout(data_dir: Path) -> None:
    """Fail with a usage error, naming the command to run, unless `data_dir` is a timewheel data directory."""
    from timewheel.app.datadir import DataDirError, open_data_dir

    try:
        open_data_dir(data_dir)
    except DataDirError as e:
        _fail(str(e))


@contextmanager
def _reading(data_dir: Path) -> Iterator[None]:
    """Exit 2 naming the file, as `inspect` and `find` do, when the job refuses a file it cannot read."""
    from spark._util import UnreadableDataError
    from timewheel.app.datadir import read_error

    try:
        yield
    except UnreadableDataError as e:
        _fail(read_error(data_dir, e))


def _require_inputs(inputs: Sequence[str]) -> None:
    """Fail naming the first local input that is not there, before a Spark session is paid for.

    A URL (hdfs://, s3a://, ...) or a glob is left for Spark to resolve: `_read_input` reports those.
    """
    for item in inputs:
        if "://" in item or any(c in item for c in "*?[{"):
            continue
        path = Path(item[len("file:"):] if item.startswith("file:") else item)
        if not path.exists():
            _fail(f"backfill input {item} does not exist: give Parquet, JSON lines or CSV files or directories")


def _read_input(spark: "SparkSession", inputs: Sequence[str], fmt: str | None) -> "DataFrame":
    """`spark.backfill.read_input`, an input Spark cannot find or read failing in one line."""
    from pyspark.errors import AnalysisException

    from spark.backfill import read_input

    try:
        return read_input(spark, inputs, fmt)
    except AnalysisException as e:  # a missing path, or files not of the format (e.g. Parquet read as JSON)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        _fail(f"cannot read the backfill input ({first}): give Parquet, JSON lines or CSV files or directories, "
              "and --format when their names do not say which")


def backfill(
    inputs: Annotated[list[str], typer.Argument(help="Input files or directories (Parquet, JSON lines or CSV).",
                                                metavar="INPUT")],
    data_dir: DataDir,
    fmt: Annotated[Optional[InputFormat], typer.Option("--format", help="Input format (default: from the first "
                                                                       "input's suffix, else parquet).")] = None,
    rejects: Annotated[Path, typer.Option("--rejects", help="Where rejected rows go, with their reason: a Parquet "
                                                            "directory, or JSON when it ends in .json. Replaced "
                                                            "on each run.")] = Path("timewheel-rejects"),
    past_due: Annotated[PastDue, typer.Option("--past-due", help="Rows due in a segment already past: reject "
                                                                 "them, or schedule them for now.")] = PastDue.reject,
    max_delay_ms: Annotated[int, typer.Option("--max-delay-ms", min=0, help="Refuse rows due further ahead.")]
    = _ENGINE_DEFAULTS["max_delay_ms"],
    max_body_bytes: Annotated[int, typer.Option("--max-body-bytes", min=0, help="Refuse larger bodies.")]
    = _ENGINE_DEFAULTS["max_body_bytes"],
    body_encoding: Annotated[str, typer.Option("--body-encoding", help="How text bodies are turned into bytes: "
                                                                       "utf-8 or base64.")] = "utf-8",
    partitions: Annotated[Optional[int], typer.Option("--partitions", min=1, help="Write tasks (default: sized by "
                                                                           "Spark's adaptive execution).")] = None,
    master: Master = "local[*]",
    conf: Conf = None,
    as_json: AsJson = False,
    verbose: Verbose = False,
) -> None:
    """Bulk-schedule messages into sealed parts of a data directory.

    Input columns are named like timewheel.Message's fields: topic, body, deliver_at_ms (epoch ms)
    or deliver_at (timestamp or ISO-8601 text), and optionally keys, tags, properties, msg_id.
    Rows without msg_id get one derived from their content, so running the same backfill twice
    schedules nothing twice. Rows that break the contract (no topic, unparsable time, delay past
    the maximum, body too large, ...) are written to --rejects with their reason. A running engine
    picks the new parts up (it rescans loaded segments every few seconds).

    Exits 1 when rows were rejected (the others are scheduled), 2 on a usage error or an input it
    cannot read (missing, or not of its format).
    """
    _open_layout(data_dir)
    if body_encoding not in ("utf-8", "base64"):
        _fail("--body-encoding must be utf-8 or base64")
    _require_inputs(inputs)
    from timewheel.app.settings import load_settings
    from timewheel.errors import ConfigError

    try:  # the engine's own topics (TIMEWHEEL_ROCKETMQ_* when set) are never targets
        rmq = load_settings(None, None, {"engine": {"data_dir": data_dir}}).rocketmq
    except ConfigError as e:
        _fail(str(e))
    from spark.backfill import backfill as run
    from spark.progress import stage_progress

    undone = ("no part of this backfill was published unless it had finished: run it again to schedule what it "
              "did not (rows already scheduled are never scheduled twice)")
    with _spark(master, conf, verbose, undone=undone) as spark, _reading(data_dir):
        with stage_progress(spark, "backfill", enabled=not as_json):
            try:
                source = _read_input(spark, inputs, fmt.value if fmt else None)
                result = run(spark, data_dir, source, rejects_path=rejects, max_delay_ms=max_delay_ms,
                             max_body_bytes=max_body_bytes, past_due=past_due.value, body_encoding=body_encoding,
                             partitions=partitions, reserved_topics=frozenset({rmq.delay_topic, rmq.dead_letter_topic}))
            except ValueError as e:
                _fail(str(e))
    if as_json:
        print_json(result.as_dict())
    else:
        print_backfill(result)
    if result.rejected:
        raise typer.Exit(1)


def audit(
    data_dir: DataDir,
    out: Annotated[Path, typer.Option("--out", help="Where report.json, findings/ (Parquet) and lateness.png "
                                                    "go.")] = Path("timewheel-audit"),
    grace_seconds: Annotated[float, typer.Option("--grace-seconds", min=0, help="A record due less than this long ago "
                                                                         "is not lost yet.")] = 300.0,
    now: Annotated[Optional[str], typer.Option("--now", help="Audit as of this time (ISO-8601 or epoch ms; "
                                                             "default: the wall clock).")] = None,
    master: Master = "local[*]",
    conf: Conf = None,
    as_json: AsJson = False,
    verbose: Verbose = False,
) -> None:
    """Reconcile what was scheduled with what was dispatched; find lost, duplicated, corrupt records.

    Per segment and topic: scheduled = dispatched + cancelled + dead-lettered + corrupt + pending,
    and delivery lateness p50/p99/max. Findings: lost records (past due by more than the grace, no
    terminal outcome), duplicates (delivered more than once; replays are not duplicates), corrupt
    records, records a part of a segment ended before the grace cannot give back (its index names
    them past the end of its log, or it has no index), dispatch entries naming no record. Writes
    report.json, findings/ and lateness.png to --out; --json prints the report.

    Reads files only, so it is safe beside a running engine. Exits 1 when it finds lost, duplicated,
    corrupt or unreadable records, or dispatch entries naming no record in a segment ended before
    the grace.
    """
    _require_finite(grace_seconds, "--grace-seconds")
    _open_layout(data_dir)
    now_ms = _time_ms(now, "--now") if now else time.time_ns() // 1_000_000
    from spark.audit import run_audit
    from spark.progress import stage_progress

    # the audit's per-record work is numpy in the Python workers: a light driver JVM saves CPU
    undone = f"the audit did not finish: it found nothing either way, and {out} holds no report of this run"
    with _spark(master, conf, verbose, undone=undone, light_jvm=True) as spark, _reading(data_dir):
        with stage_progress(spark, "audit", enabled=not as_json):
            rep = run_audit(spark, data_dir, now_ms=now_ms, grace_ms=int(grace_seconds * 1000), out_dir=out)
    if as_json:
        print_json(rep.as_dict())
    else:
        print_audit(rep)
    if rep.failed:
        raise typer.Exit(1)


def replay(
    data_dir: DataDir,
    since: Annotated[str, typer.Option("--since", help="First due time replayed (ISO-8601 or epoch ms).")],
    until: Annotated[str, typer.Option("--until", help="Records due before this are replayed (ISO-8601 or epoch "
                                                       "ms).")],
    topic: Annotated[Optional[str], typer.Option("--topic", help="Only this target topic.")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would be sent; send and record "
                                                            "nothing.")] = False,
    namesrv: Annotated[Optional[str], typer.Option("--namesrv", help="RocketMQ NameServer HOST:PORT (default: "
                                                                      "rocketmq.namesrv of the config).")] = None,
    config: Annotated[Optional[Path], typer.Option("--config", help="TOML config file: its [rocketmq] section "
                                                   "(NameServer, ACL credentials, TLS) is used to send.")] = None,
    group: Annotated[str, typer.Option("--group", help="Producer group.")] = "timewheel-replay",
    rate: Annotated[float, typer.Option("--rate", min=0, help="Messages a second per executor (0: unlimited).")] = 1000.0,
    show: Annotated[int, typer.Option("--show", min=0, help="Messages listed by --dry-run.")] = 20,
    master: Master = "local[*]",
    conf: Conf = None,
    as_json: AsJson = False,
    verbose: Verbose = False,
) -> None:
    """Re-send the records due in [--since, --until) to their topics, from the Spark executors.

    One producer per task; --rate bounds each executor. Each message carries its body, tags, keys and properties, plus TW_ORIGINAL_MSG_ID and
    TW_REPLAY=1; each one sent is recorded as REPLAYED in its segment's dispatch log (the audit does
    not count replays as duplicates). Exits 1 when a message could not be sent, when records due in
    the range are corrupt (skipped, counted on stderr), or when records of a part no longer written
    cannot be read (each such part named on stderr): the rest is sent; --dry-run exits 1 on those too.
    """
    _require_finite(rate, "--rate")
    _open_layout(data_dir)
    since_ms, until_ms = _time_ms(since, "--since"), _time_ms(until, "--until")
    if until_ms <= since_ms:
        _fail("--until must be after --since")
    from spark.progress import stage_progress
    from forwarder.replay_sender import replay_sender_for
    from spark.replay import replay as run
    from timewheel.app.settings import load_settings
    from timewheel.errors import ConfigError

    try:  # the engine's own [rocketmq] settings: TOML, then TIMEWHEEL_ROCKETMQ_*, then --namesrv
        cfg = load_settings(config, None, {"engine": {"data_dir": data_dir}, "rocketmq": {"namesrv": namesrv}}).rocketmq
    except ConfigError as e:
        _fail(str(e))
    undone = ("the dry run did not finish; nothing was sent" if dry_run else
              "the replay did not finish: some messages may have been sent (each recorded as REPLAYED in its "
              "segment's dispatch log, but for the last batch a task was sending), the rest were not")
    with _spark(master, conf, verbose, undone=undone) as spark, _reading(data_dir):
        with stage_progress(spark, "replay" if not dry_run else "replay (dry run)", enabled=not as_json):
            result = run(spark, data_dir, since_ms=since_ms, until_ms=until_ms, topic=topic, dry_run=dry_run,
                         sender_factory=None if dry_run else replay_sender_for(cfg, group), rate=rate, sample=show)
    if as_json:
        print_json(result.as_dict())
    else:
        print_replay(result)
    # a corrupt record is one the replay cannot send, as an unreadable one is: the range was not replayed whole
    skipped = [f"{'would skip' if dry_run else 'skipped'} {result.skipped_corrupt:,} corrupt record(s) due in the "
               "range (their bytes fail their checks, so they cannot be sent): "
               f"`timewheel inspect --data-dir {data_dir} --verify` names each"] if result.skipped_corrupt else []
    _exit_on_damage(result.damaged_parts, failed=bool(result.failed), skipped=skipped)


def export(
    data_dir: DataDir,
    out: Annotated[Path, typer.Option("--out", help="Output directory: records/ and dispatch/ (Parquet, by "
                                                    "segment); replaced.")],
    since: Annotated[Optional[str], typer.Option("--since", help="Only records due at or after this.")] = None,
    until: Annotated[Optional[str], typer.Option("--until", help="Only records due before this.")] = None,
    topic: Annotated[Optional[str], typer.Option("--topic", help="Only this target topic's records, and "
                                                                 "corrupt ones (topic unknown).")] = None,
    dispatch: Annotated[bool, typer.Option("--dispatch/--no-dispatch", help="Also export the dispatch "
                                                                            "logs.")] = True,
    master: Master = "local[*]",
    conf: Conf = None,
    as_json: AsJson = False,
    verbose: Verbose = False,
) -> None:
    """Export segments to Parquet for analysts.

    records/: every record with its status and lateness; dispatch/: the dispatch-log entries. Both
    partitioned by segment. Exits 1 when records of a part no longer written cannot be read (the
    rest is written; each such part is named on stderr).
    """
    _open_layout(data_dir)
    since_ms = _time_ms(since, "--since") if since else None
    until_ms = _time_ms(until, "--until") if until else None
    from spark.export import export as run
    from spark.progress import stage_progress

    undone = f"the export did not finish: {out} holds only part of it (the data directory is unchanged)"
    with _spark(master, conf, verbose, undone=undone) as spark, _reading(data_dir):
        with stage_progress(spark, "export", enabled=not as_json):
            result = run(spark, data_dir, out, since_ms=since_ms, until_ms=until_ms, topic=topic, dispatch=dispatch)
    if as_json:
        print_json(result.as_dict())
    else:
        print_export(result)
    _exit_on_damage(result.damaged_parts)


def _exit_on_damage(parts: list[dict], *, failed: bool = False, skipped: Sequence[str] = ()) -> None:
    """Name each unreadable part (`PartDamage.detail`) and say each line of `skipped` (records the job
    passed over) on stderr, then exit 1 if any, or if the job `failed`."""
    for line in [*(part["detail"] for part in parts), *skipped]:
        typer.echo(f"timewheel: {line}", err=True)
    if parts or skipped or failed:
        raise typer.Exit(1)


def _help(doc: str | None) -> str:
    """A docstring as help text: paragraphs kept, lines inside a paragraph joined."""
    import inspect

    paragraphs = inspect.cleandoc(doc or "").split("\n\n")
    return "\n\n".join(" ".join(line.strip() for line in p.splitlines()) for p in paragraphs)


def register(app: typer.Typer) -> None:
    """Add the backfill, audit, replay and export commands to the `timewheel` CLI."""
    for name, fn in (("backfill", backfill), ("audit", audit), ("replay", replay), ("export", export)):
        app.command(name, help=_help(fn.__doc__))(fn)
