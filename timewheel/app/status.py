"""`timewheel status`: one screen for whoever is on call, from the admin endpoint's GET /status.

The engine side (`status_document`) turns the service's stats, the delay topic's ingest lag and
the last minute of lateness into one JSON document (times in epoch ms); the command side
(`fetch_status`, `render_status`) reads it over HTTP and prints it for people (times in UTC).
"""
from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from typing import Any, Mapping, Protocol, Sequence

from rich.columns import Columns
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from timewheel.app.humantime import human_time
from timewheel.app.ingest_lag import QueueLag, lag_dict
from timewheel.errors import TimewheelError


class StatusError(TimewheelError):
    """The admin endpoint could not be read; the message says what to check."""


def _num(stats: Mapping[str, object], key: str) -> int:
    value = stats.get(key, 0)
    return int(value) if isinstance(value, (int, float)) else 0


def status_document(stats: Mapping[str, object], *, serving: bool, now_ms: int, lag: Sequence[QueueLag] | None,
                    lag_error: str | None, lateness_ms: Sequence[float], lateness_count: int,
                    lateness_span_ms: int, not_serving_why: Sequence[str] = ()) -> dict[str, Any]:
    """The GET /status document (epoch ms; `lateness_ms` is p50, p99 of the last minute;
    `not_serving_why`: why it is not ready, `timewheel.app.readiness`)."""
    shaping: Mapping[str, object] = stats.get("shaping") or {}  # type: ignore[assignment]
    segments: Mapping[str, int] = stats.get("loaded_segments") or {}  # type: ignore[assignment]
    ingest: Mapping[str, object] = stats.get("ingest") or {}  # type: ignore[assignment]
    queues = [lag_dict(q) for q in lag or ()]
    return {
        "now_ms": now_ms,
        "serving": serving,
        "not_serving_why": list(not_serving_why),
        "ingest": {"queues": queues, "lag": sum(q.lag for q in lag or ()), "error": lag_error, **ingest},
        "pending_by_segment": [{"segment_ms": int(k), "pending": int(v)} for k, v in sorted(segments.items())],
        **{k: _num(stats, k) for k in ("ready", "backlog", "retrying", "held_by_shaping", "wheel_entries",
                                        "scheduled", "delivered", "cancelled", "storage_corrupt_origin_rows",
                                        "storage_origin_rows_lost")},
        # to an operator both are messages on the dead-letter topic: broke the contract, or failed every attempt
        "dead_lettered": _num(stats, "dead_lettered") + _num(ingest, "dead_lettered"),
        "dead_lettered_at_ingest": _num(ingest, "dead_lettered"),
        "dead_lettered_after_retries": _num(stats, "dead_lettered"),
        "lateness_last_minute_ms": {"p50": lateness_ms[0], "p99": lateness_ms[1], "count": lateness_count,
                                    "span_ms": lateness_span_ms},
        "shaping": {"circuit_open": bool(stats.get("circuit_open", False)), "paused": bool(shaping.get("paused")),
                    **{k: shaping.get(k, 0) for k in ("waiting", "backed_off_topics", "global_rate", "throttled",
                                                      "topics_tracked", "topics_not_listed")},
                    "backed_off": sorted(t for t, row in (shaping.get("topics") or {}).items()  # type: ignore
                                         if row.get("backed_off")),
                    "rules": shaping.get("rules")},
        # the host's clock against the brokers' (`forwarder.clock_check`), when it is measured
        "broker_clock": stats.get("broker_clock"),
    }


class _Snapshots(Protocol):
    def snapshot(self) -> dict[str, int]: ...


class _Statuses(Protocol):
    def status(self) -> dict[str, object]: ...


def dedupe_status(finder: _Statuses | None, recovery: _Snapshots | None) -> dict[str, Any]:
    """The look-ups before sending again: on or off, what they did (`recovery`, the engine's), the brokers'
    index settings (`finder`, the copy finder; None: rocketmq.dedupe is off)."""
    if finder is None:
        return {"enabled": False, "note": "rocketmq.dedupe is off: after a crash or takeover, messages may be "
                                          "delivered twice (consumers dedupe on TW_ORIGINAL_MSG_ID)"}
    return {"enabled": True, **(recovery.snapshot() if recovery is not None else {}), **finder.status()}


def unreachable(admin: str, reason: object) -> str:
    """What to say when nothing answers at the admin address, and what to check."""
    return (f"cannot reach the admin endpoint at {admin} ({reason}): is `timewheel serve` running? "
            "give its admin address with --admin HOST:PORT (settings: admin.listen)")


def fetch_status(admin: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """GET http://ADMIN/status as a dict."""
    url = f"http://{admin}/status"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            doc: dict[str, Any] = json.loads(resp.read())
            return doc
    except urllib.error.HTTPError as e:
        raise StatusError(f"the engine at {admin} answered HTTP {e.code} for /status: "
                          f"{e.read().decode(errors='replace').strip()}") from e
    except urllib.error.URLError as e:
        raise StatusError(unreachable(admin, e.reason)) from e
    except http.client.InvalidURL as e:  # a port that is not a number, a space in the host: nothing was asked
        raise StatusError(f"--admin {admin!r} is not HOST:PORT ({e}): give the engine's admin address "
                          "(settings: admin.listen)") from e
    except ValueError as e:
        raise StatusError(f"{url} did not answer JSON: is {admin} a timewheel admin endpoint?") from e


def _lateness_text(late: Mapping[str, Any]) -> str:
    if not late.get("count"):
        return "no deliveries in the last minute"
    span = f"last {late['span_ms'] / 1000:.0f} s" if late.get("span_ms") else "since start"
    return f"p50 {late['p50']:.1f} ms, p99 {late['p99']:.1f} ms over {late['count']:,} deliveries ({span})"


def _shaping_text(sh: Mapping[str, Any]) -> str:
    parts = ["circuit OPEN: sends held back" if sh.get("circuit_open") else "circuit closed"]
    if sh.get("paused"):
        parts.append("PAUSED")
    backed = sh.get("backed_off") or []
    more = int(sh.get("backed_off_topics") or 0) - len(backed)  # the shaper lists a bounded number of topics
    parts.append(f"backed off: {', '.join(backed)}{f' (+{more:,} more)' if more > 0 else ''}" if backed
                 else "no topic backed off")
    parts.append(f"{sh.get('waiting', 0):,} waiting")
    parts.append(f"global cap {sh['global_rate']:g}/s" if sh.get("global_rate") else "no global cap")
    rules = sh.get("rules") or {}
    if rules:
        since = f" at {human_time(rules['applied_ms'])}" if rules.get("applied_ms") else ""
        parts.append(f"rules from {rules.get('source', '?')}{since}")
        if rules.get("last_error"):
            parts.append(f"last refusal: {rules['last_error']}")
    return "; ".join(parts)


def render_status(doc: Mapping[str, Any], admin: str) -> RenderableType:
    """The status document as one screen: a headline, three small tables, the shaping line."""
    head = Text.assemble(("timewheel ", "bold"), f"at {admin}, {human_time(doc['now_ms'])}: ",
                         ("serving", "green") if doc.get("serving") else ("NOT serving", "bold red"))
    deliver = Table(title="delivery", show_header=False)
    deliver.add_column("what")
    deliver.add_column("n", justify="right")
    for label, key in (("ready to send", "ready"), ("retrying", "retrying"), ("dead-lettered", "dead_lettered"),
                       ("catch-up backlog", "backlog"), ("held by shaping", "held_by_shaping"),
                       ("in the wheel", "wheel_entries"), ("delivered", "delivered")):
        deliver.add_row(label, f"{doc.get(key, 0):,}")
    ingest = doc.get("ingest") or {}
    lag = Table(title=f"ingest lag: {ingest.get('lag', 0):,}")
    for c in ("queue", "offset", "committed", "lag"):
        lag.add_column(c, justify="right" if c != "queue" else "left")
    for q in ingest.get("queues") or []:
        lag.add_row(f"{q['broker']}/{q['queue']}", f"{q['max_offset']:,}",
                    f"{q['committed']:,}" if q["committed"] >= 0 else "none", f"{q['lag']:,}")
    pending = Table(title="pending by segment")
    pending.add_column("segment (UTC)", no_wrap=True)
    pending.add_column("pending", justify="right")
    for row in doc.get("pending_by_segment") or []:
        pending.add_row(human_time(row["segment_ms"]), f"{row['pending']:,}")
    lines: list[RenderableType] = [head, Columns([deliver, lag, pending]),
                                   Text(f"lateness: {_lateness_text(doc.get('lateness_last_minute_ms') or {})}"),
                                   Text(f"shaping: {_shaping_text(doc.get('shaping') or {})}")]
    lines[1:1] = [Text(f"not serving: {why}", style="red") for why in doc.get("not_serving_why") or []]
    if ingest.get("error"):
        lines.append(Text(f"ingest lag unknown: {ingest['error']}", style="red"))
    if doc.get("ha"):
        lines.extend(_ha_lines(doc["ha"]))
    if doc.get("dedupe"):
        lines.extend(_dedupe_lines(doc["dedupe"]))
    if doc.get("broker_clock"):
        lines.extend(_clock_lines(doc["broker_clock"]))
    if doc.get("storage_corrupt_origin_rows"):
        lines.append(Text(f"WARNING: {doc['storage_corrupt_origin_rows']:,} origin sidecar row(s) fail their CRC32C "
                          "(damage, or data a power loss did not keep): in a replica set a standby holds their "
                          "records and sends them only once it holds the lease; the log and `timewheel inspect "
                          "--verify` name each sidecar.", style="yellow"))
    if doc.get("storage_origin_rows_lost"):
        lines.append(Text(f"WARNING: {doc['storage_origin_rows_lost']:,} origin sidecar row(s) written as lost since the "
                          "start (an OS crash took them, or a sidecar was cut or deleted): their records stay stored; "
                          "in a replica set a standby holds them and sends them only once it holds the lease; the "
                          "log names each sidecar.", style="yellow"))
    slow = sorted(k for k, compiled in (doc.get("hot_paths") or {}).items() if not compiled)
    if slow:
        lines.append(Text(f"WARNING: hot paths in pure Python (not built at install): {', '.join(slow)}; "
                          "several times the CPU per message. Reinstall with a C compiler.", style="yellow"))
    return Group(*lines)


def _dedupe_lines(d: Mapping[str, Any]) -> list[RenderableType]:
    """The look-ups before sending again: what they did, and what could let a duplicate through."""
    if not d.get("enabled"):
        return [Text(f"dedupe OFF: {d.get('note', '')}", style="yellow")]
    out: list[RenderableType] = [Text(
        f"dedupe: {d.get('episodes', 0)} restarts/takeovers resolved; looked up {d.get('looked_up', 0):,}: "
        f"found {d.get('found', 0):,} (not sent again), missing {d.get('missing', 0):,} (sent), unknown "
        f"{d.get('unknown', 0):,} (waiting); barriers {d.get('barriers', 0)}, slowest {d.get('resolve_ms_max', 0)} ms")]
    out += [Text(f"WARNING: {w}", style="yellow") for w in d.get("warnings") or []]
    return out


def _clock_lines(c: Mapping[str, Any]) -> list[RenderableType]:
    """The host's clock against the brokers' as last measured, and whether sends are held for it."""
    if c.get("offset_ms") is None:
        line = Text("clock: not measured against the brokers' yet")
    else:
        held = "sends HELD" if c.get("holding") else "sends not held"
        line = Text(f"clock: this host {c['offset_ms']:+,} ms against broker {c.get('broker')} (host minus broker; "
                    f"{held}, bound {c.get('max_ahead_ms', 0):,} ms)", style="red" if c.get("holding") else "")
    return [line, *(Text(f"WARNING: {w}", style="yellow") for w in c.get("warnings") or [])]


def _ha_lines(ha: Mapping[str, Any]) -> list[RenderableType]:
    """The replica set: this replica's role, then every shard's holder, epoch, watermark and its lag."""
    me = ha.get("replica") or {}
    role = f"HOLDS the lease, epoch {me.get('epoch')}" if me.get("holder") else "standby (stores, does not send)"
    out: list[RenderableType] = [Text(f"replica {me.get('replica')} of shard {me.get('shard')}/{me.get('shards')}: "
                                      f"{role}; takeovers {me.get('takeovers', 0)}, possible duplicates at takeover "
                                      f"{me.get('possible_duplicates', 0)}, recorded as delivered by the holder "
                                      f"{me.get('peer_delivered', 0):,}")]
    if me.get("eligible") is False or me.get("gap"):  # a gap or a catch-up keeps it out of the lease
        out.append(Text(f"NOT ELIGIBLE for the lease: {me.get('eligibility')}" if me.get("eligible") is False
                        else f"eligible ({me.get('eligibility')}), but its data directory has a gap: {me.get('gap')}",
                        style="yellow"))
    if me.get("zookeeper_failed_rounds"):  # a blip; past a session, also a reason not to serve (above)
        since = human_time(me["zookeeper_failing_since_ms"])
        out.append(Text(f"WARNING: ZooKeeper has failed every round since {since} ({me['zookeeper_failed_rounds']} "
                        f"rounds; the last: {me.get('zookeeper_last_error')}): not sending, not taking the lease over",
                        style="yellow"))
    if me.get("dedupe_brokers_unpublished"):  # a holder that learnt a broker it cannot publish sends nothing
        out.append(Text(f"WARNING: {me['dedupe_brokers_unpublished']}", style="red"))
    out += [Text(f"WARNING: {w}", style="yellow") for w in me.get("dedupe_brokers_unreadable") or []]
    table = Table(title="shards")
    for c in ("shard", "holder", "epoch", "standbys", "watermark (UTC)", "lag"):
        table.add_column(c)
    for row in ha.get("shards") or []:
        mark = row.get("watermark_ms", -1)
        table.add_row(str(row["shard"]), row.get("holder") or "NONE", str(row.get("epoch", 0)),
                      ", ".join(row.get("standbys") or []) or "-", human_time(mark) if mark >= 0 else "none yet",
                      f"{row['lag_ms'] / 1000:.1f} s" if row.get("lag_ms") is not None else "-")
    out.append(table)
    if ha.get("shards_error"):
        out.append(Text(str(ha["shards_error"]), style="red"))
    return out
