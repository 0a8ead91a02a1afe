"""`timewheel find`: where is my message, by id or business key, from the data directory.

`register(app)` adds the command to the main Typer app; it parses, calls
`timewheel.find.MessageFinder` (the same look-up `GET /messages` answers with) and prints.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from timewheel.app.datadir import data_dir_option
from timewheel.find import DEFAULT_LIMIT, MAX_LIMIT

__all__ = ["find", "register", "render"]


def find(
    data_dir: Annotated[Path, typer.Option("--data-dir", parser=data_dir_option, metavar="<path>",
                                           help="The engine's data directory.")],
    msg_id: Annotated[Optional[str], typer.Option(
        "--id", help="The id the producer's send returned (UNIQ_KEY), or the engine's id "
                     "(TW_ORIGINAL_MSG_ID on a delivered copy).")] = None,
    key: Annotated[Optional[str], typer.Option("--key", help="A business key (RocketMQ keys) the message carries.")]
    = None,
    limit: Annotated[int, typer.Option("--limit", min=1, max=MAX_LIMIT,
                                       help="At most this many messages (a key may be shared by many).")]
    = DEFAULT_LIMIT,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object (times in epoch ms).")] = False,
) -> None:
    """Find a delay message by id or key and show its timeline: stored, cancels that name it, each
    send attempt (the broker's message id for `mqadmin queryMsgById`, or the error), dead letter,
    or what it still waits for.

    Reads the files only, so it is safe beside a running engine. Exits 1 when no message matches,
    2 when the data directory, or a file in it, cannot be read.
    """
    from storage import MetaStore, StorageError
    from timewheel.app.datadir import DataDirError, open_data_dir, read_error, require_directories
    from timewheel.find import MessageFinder

    if (msg_id is None) == (key is None):
        typer.echo("timewheel: give exactly one of --id or --key", err=True)
        raise typer.Exit(2)
    option, text = ("--id", msg_id) if msg_id is not None else ("--key", key or "")
    problem = None if text.strip() else "is empty: give the id the producer's send returned, or a key it carries"
    try:
        text.encode()
    except UnicodeEncodeError:  # argv bytes that were not UTF-8: no message carries them
        problem = f"{text!r:.80} is not valid UTF-8: give it as UTF-8 text"
    if problem:
        typer.echo(f"timewheel: {option} {problem}", err=True)
        raise typer.Exit(2)
    try:
        layout = open_data_dir(data_dir)
        require_directories(layout)  # else a look-up takes the one that is a file for empty: "no stored message"
        if not MetaStore.exists(layout.meta_dir):  # made by `init`, never served: nothing is stored yet
            note = f"no engine has stored anything in {data_dir} yet (`timewheel serve --data-dir {data_dir}`)"
            if as_json:
                typer.echo(json.dumps({"query": {option[2:]: text}, "count": 0, "truncated": False, "messages": []}))
                typer.echo(f"timewheel: {note}", err=True)
            else:
                typer.echo(f"no stored message with {option[2:]} {text!r}: {note}")
            raise typer.Exit(1)
        with MessageFinder.beside_engine(data_dir) as finder:
            now = int(time.time() * 1000)
            found = finder.by_id(msg_id, now, limit) if msg_id is not None else finder.by_key(key or "", now, limit)
    except (DataDirError, StorageError) as e:
        typer.echo(f"timewheel: {e}", err=True)
        raise typer.Exit(2) from e
    except OSError as e:
        typer.echo(f"timewheel: {read_error(data_dir, e)}", err=True)
        raise typer.Exit(2) from e
    data = found.to_dict()
    if as_json:
        typer.echo(json.dumps(data))
    else:
        typer.echo(render(data))
    if not found.trails:
        raise typer.Exit(1)


def render(data: dict[str, Any]) -> str:
    """The look-up's answer as text for a person."""
    from timewheel.app.humantime import human_time

    (how, what), = data["query"].items()
    if not data["messages"] and data.get("cancels"):
        lines = [f"no stored message with {how} {what!r}, but a cancel names it: a message that arrives while "
                 "its cancel is kept is cancelled on arrival, never stored (timewheel_cancelled_on_arrival_total)"]
        lines += [f"  {human_time(c['at_ms']):<26} {_describe(c)}, kept until {human_time(c['kept_until_ms'])}"
                  for c in data["cancels"]]
        return "\n".join(lines)
    if not data["messages"]:
        return (f"no stored message with {how} {what!r}. A message that broke the producer contract went to the "
                "dead-letter topic instead (`mqadmin queryMsgByKey -t TW_DLQ -k KEY`); one retired with its "
                "segment is gone from the data directory; another engine of the group may hold it.")
    more = (" (more not shown: raise --limit)" if data["count"] < MAX_LIMIT else
            f" (more not shown: {MAX_LIMIT} is the most one look-up shows; ask for any other by its id)")
    lines = [f"{data['count']} message(s) with {how} {what!r}" + (more if data["truncated"] else "")]
    for m in data["messages"]:
        lines.append("")
        lines.append(f"{m['msg_id']}  {m['state'].upper()}")
        if "topic" in m:
            lines.append(f"  to {m['topic']}  tags {m['tags'] or '-'}  keys {' '.join(m['keys']) or '-'}  "
                         f"{m['body_bytes']} bytes  due {human_time(m['due_ms'])}")
        for s in m["steps"]:
            at = human_time(s["at_ms"]) if s["at_ms"] else "(time unknown)"
            lines.append(f"  {at:<26} {_describe(s)}")
    return "\n".join(lines)


def _describe(s: dict[str, Any]) -> str:
    what = s["what"]
    if what == "stored":
        return f"stored in segment {s['segment']} part {s['part']} at offset {s['offset']}"
    if what == "unreadable":
        return f"record unreadable at segment {s['segment']} part {s['part']}: {s['error']}"
    if what == "cancel_received":
        return f"cancel by {s['by']} {s.get('id') or s.get('key')!r} received"
    if what in ("delivered", "replayed"):
        where = (f": broker message id {s['broker_msg_id']} (`mqadmin queryMsgById -t {s.get('topic', 'TOPIC')} "
                 f"-i {s['broker_msg_id']}`), queue {s['queue_id']} offset {s['queue_offset']}"
                 if "queue_offset" in s else "")
        verb = "delivered" if what == "delivered" else "re-sent by an operator's replay"
        return f"{verb} to {s.get('topic', '?')} on attempt {s['attempt']}{where}"
    if what == "delivered_by_lease_holder":
        return "recorded as delivered by the shard's lease holder (this standby did not send it)"
    if what == "send_failed":
        return f"attempt {s['attempt']} failed: {s['error']}; retried after a backoff"
    if what == "dead_lettered":
        return f"dead-lettered (to the dead-letter topic): {s['reason']}"
    if what == "cancelled":
        return "cancelled: it will not be delivered"
    if what == "found_corrupt":
        return "found corrupt when due: never served"
    if what == "pending":
        return f"pending: {s['note']}"
    return what


def register(app: typer.Typer) -> None:
    """Add the find command to the `timewheel` CLI."""
    app.command("find")(find)
