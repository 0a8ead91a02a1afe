"""`timewheel send`: one delayed message through the delay topic, as a producer would send it.

`register(app)` adds the command to the main Typer app. The message is judged first as the engine
will judge it (its contract and limits: those of `--config`, else an engine's defaults), so a
message the engine would dead-letter is refused here with the engine's reason; the body is text
(`--body`) or any bytes from a file or standard input (`--body-file`, past a shell argument's
128 KiB).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any, BinaryIO, NamedTuple, Optional

import typer

from timewheel.app._cli_errors import fail as _fail, require_utf8 as _require_utf8

__all__ = ["register", "send"]


class _Judge(NamedTuple):
    """What the message is judged by: the engine's delay topic and limits."""

    namesrv: str | None
    delay_topic: str
    dead_letter_topic: str
    max_delay_ms: int
    max_body_bytes: int
    source: str  # said with a refusal: whose settings judged it


def send(topic: Annotated[str, typer.Option(help="The target topic the message is delivered to.")],
         namesrv: Annotated[Optional[str], typer.Option(help="NameServer address, HOST:PORT (default: the "
                                                        "--config file's).")] = None,
         body: Annotated[Optional[str], typer.Option(help="Message body (UTF-8 text); or --body-file.")] = None,
         body_file: Annotated[Optional[Path], typer.Option(
             "--body-file", help="Read the body from this file as bytes, any bytes ('-': standard input).")] = None,
         delay: Annotated[Optional[str], typer.Option(help="Deliver after this long: 250ms, 30s, 5m, 2h.")] = None,
         at: Annotated[Optional[str], typer.Option(help="Deliver at this time: ISO-8601 or epoch ms.")] = None,
         keys: Annotated[Optional[str], typer.Option(help="Business key(s), space-separated.")] = None,
         tags: Annotated[Optional[str], typer.Option(help="Tags.")] = None,
         delay_topic: Annotated[Optional[str], typer.Option(help="The engine's delay topic (default: the "
                                                             "--config file's, else TW_DELAY).")] = None,
         config: Annotated[Optional[Path], typer.Option(
             "--config", help="The engine's TOML config: its NameServer, delay topic and limits (max_body_bytes, "
                              "max_delay_ms) judge the message; without it, an engine's defaults.")] = None) -> None:
    """Send one delayed message through the delay topic, as a producer would."""
    from forwarder import ForwarderError
    from forwarder._rmq_native import LogLevel, NativeProducer
    from forwarder.rocketmq import OutgoingMessage

    if namesrv is not None:  # refused at once, as `serve` refuses it, not after the client's four tries
        _check_namesrv(namesrv)
    judge = _judge(config, delay_topic)
    namesrv = namesrv or judge.namesrv
    if namesrv is None:
        _fail("give --namesrv (or --config, whose [rocketmq] namesrv is used)")
    if (delay is None) == (at is None):
        _fail("give exactly one of --delay or --at")
    if (body is None) == (body_file is None):
        _fail("give exactly one of --body or --body-file")
    for option, text in (("--topic", topic), ("--body", body), ("--keys", keys), ("--tags", tags),
                         ("--delay-topic", judge.delay_topic)):
        _require_utf8(option, text)
    payload = body.encode() if body is not None else _read_body(body_file, judge)  # type: ignore[arg-type]
    props = {"TW_TARGET_TOPIC": topic}
    try:  # one line saying what is wrong, as every other refusal here, not click's usage block
        if delay is not None:
            props["TW_DELAY_MS"] = str(_parse_delay(delay))
        else:
            props["TW_DELIVER_AT_MS"] = str(_parse_at(at))  # type: ignore[arg-type]
    except typer.BadParameter as e:
        _fail(f"{'--delay' if delay is not None else '--at'}: {e.message}")
    _check_contract(judge, payload, tags, keys, props)
    producer = NativeProducer("timewheel-cli", namesrv, log_level=LogLevel.ERROR)
    try:
        producer.start()
        res = producer.send(OutgoingMessage(judge.delay_topic, payload, tags, keys, props))
    except ForwarderError as e:
        _fail(f"send failed: {e}; is a NameServer at {namesrv} (`timewheel broker` runs a local one), does "
              f"the delay topic {judge.delay_topic} exist on its brokers, and can this host reach them? (the client "
              f"says \"No route info\" for each of these)")
    finally:
        producer.shutdown()
    typer.echo(f"sent {res.msg_id} to {judge.delay_topic} for {topic}")


def _check_namesrv(namesrv: str) -> None:
    """Fail unless `namesrv` is UTF-8 and HOST:PORT (several ';'-separated), by `serve`'s rule."""
    from forwarder.config import RocketMQConfig
    from timewheel.errors import ConfigError

    _require_utf8("--namesrv", namesrv)
    try:
        RocketMQConfig(namesrv=namesrv)
    except ConfigError as e:
        _fail(f"--namesrv: {e}")


def _judge(config: Optional[Path], delay_topic: Optional[str]) -> _Judge:
    """The settings the message is judged by: `--config`'s (its file, then TIMEWHEEL_* variables), or
    an engine's defaults; `--delay-topic` over either."""
    from forwarder.config import RocketMQConfig
    from timewheel.app.settings import load_settings
    from timewheel.config import EngineConfig
    from timewheel.errors import ConfigError

    try:
        if config is None:
            rmq = RocketMQConfig() if delay_topic is None else RocketMQConfig(delay_topic=delay_topic)
            return _Judge(None, rmq.delay_topic, rmq.dead_letter_topic, EngineConfig.max_delay_ms,
                          EngineConfig.max_body_bytes, "as an engine with default settings judges it")
        # the data directory is not read here: any name does for the settings to load
        overrides: dict[str, dict[str, Any]] = {"engine": {"data_dir": "."}, "rocketmq": {"delay_topic": delay_topic}}
        settings = load_settings(config, None, overrides)
    except ConfigError as e:
        _fail(f"--delay-topic: {e}" if config is None else f"--config: {e}")
    rmq, eng = settings.rocketmq, settings.engine
    return _Judge(rmq.namesrv, rmq.delay_topic, rmq.dead_letter_topic, eng.max_delay_ms, eng.max_body_bytes,
                  f"as an engine with {config} judges it")


def _read_body(path: Path, judge: _Judge) -> bytes:
    """The body from `path` ('-': standard input), refused past the engine's max_body_bytes without
    reading more than one byte past it."""
    limit = judge.max_body_bytes
    try:
        if str(path) == "-":
            data = _read_at_most(sys.stdin.buffer, limit + 1)
        else:
            with open(path, "rb") as f:
                data = _read_at_most(f, limit + 1)
    except OSError as e:
        _fail(f"--body-file: cannot read {path}: {e.strerror or e}")
    if len(data) > limit:
        _fail(f"the engine would dead-letter this message: the body of {path} is over the maximum of {limit} "
              f"bytes ({judge.source})")
    return data


def _read_at_most(f: BinaryIO, n: int) -> bytes:
    """Up to `n` bytes of `f` (a pipe may give them in pieces)."""
    chunks, got = [], 0
    while got < n:
        chunk = f.read(n - got)
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


#: epoch ms below this (1973-03-03) are taken for epoch seconds given by mistake, never for a due time
_EPOCH_MS_FLOOR = 10**11


def _parse_delay(text: str) -> int:
    """'30s', '5m', '2h', '1d', '250ms' or plain milliseconds -> milliseconds."""
    import re

    from decimal import Decimal

    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|h|d)?\s*", text)
    if not m:
        raise typer.BadParameter(f"{text!r} is not a delay: use e.g. 250ms, 30s, 5m, 2h, 1d")
    unit = {"ms": 1, None: 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}[m.group(2)]
    # Decimal, not float: a float is inexact past 2**53 and overflows on a long run of digits
    return int(Decimal(m.group(1)) * unit)


def _parse_at(text: str) -> int:
    """ISO-8601 (UTC unless an offset is given) or epoch ms -> epoch ms."""
    import re
    from datetime import datetime, timezone

    if re.fullmatch(r"[0-9]+", text):  # ASCII only: str.isdigit takes full-width and other digits
        ms = int(text)
        if ms < _EPOCH_MS_FLOOR:  # a classic producer mistake: epoch seconds where ms are asked for
            raise typer.BadParameter(f"{text} is epoch ms in {datetime.fromtimestamp(ms / 1000, timezone.utc):%Y-%m-%d}; "
                                     f"if it is epoch seconds, give --at {text}000 (ms) or ISO-8601")
        return ms
    try:
        dt = datetime.fromisoformat(text)
    except ValueError as e:
        raise typer.BadParameter(f"{text!r} is not ISO-8601 (e.g. 2027-01-15T08:00:00Z) nor epoch ms") from e
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return int(dt.timestamp() * 1000)


def _check_contract(judge: _Judge, body: bytes, tags: Optional[str], keys: Optional[str],
                    props: dict[str, str]) -> None:
    """Fail, with the engine's reason, on a message the judging engine would dead-letter; say so when
    its due time is past (the contract delivers it at once)."""
    import time

    from forwarder.contract import (DELIVER_AT_MS, DELIVERY_PROPERTIES_BUDGET, TARGET_TOPIC, ContractLimits,
                                    ContractViolation, check_target_topic, properties_size, to_message)
    from forwarder.rocketmq.message import ReceivedMessage

    delay_topic = judge.delay_topic
    now = int(time.time() * 1000)
    limits = ContractLimits(judge.max_delay_ms, judge.max_body_bytes, frozenset({delay_topic, judge.dead_letter_topic}))
    # as the engine will read it: its own id is as long as a real one, born now
    received = ReceivedMessage(delay_topic, body, tags or "", keys or "", "0" * 32, dict(props), 0, 0, 0, 0, now, now)
    try:
        check_target_topic(props[TARGET_TOPIC], limits.reserved_topics)
        due = to_message(received, now, limits).deliver_at_ms
    except ContractViolation as e:
        _fail(f"the engine would dead-letter this message: {e.reason} ({judge.source})")
    # the delay message carries the target's name and the due time, which its delivered copy does not
    size = properties_size(props, tags, keys)
    if size > DELIVERY_PROPERTIES_BUDGET:
        _fail(f"properties, tags and keys take {size} bytes on {delay_topic}, over the {DELIVERY_PROPERTIES_BUDGET} "
              f"RocketMQ's limit leaves once the client's own are added: shorten --keys or --tags")
    if DELIVER_AT_MS in props and due < now:
        typer.echo(f"timewheel: note: --at is {(now - due) / 1000:,.1f} s in the past: the engine delivers the "
                   f"message at once", err=True)


def register(app: typer.Typer) -> None:
    """Add the send command to the `timewheel` CLI."""
    app.command("send")(send)
