"""What `serve` checks before anything connects, the error a start refused raises, and how a failed
start is undone.

Each refusal is a `StartError` whose text is the one line the command prints (exit 2): what is
wrong and what to do.
"""
from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from timewheel.errors import TimewheelError

if TYPE_CHECKING:
    from coordination import HAConfig
    from coordination.identity import ReplicaDataDir

__all__ = ["StartError", "check_zookeeper_reachable", "claim_data_dir", "undo_failed_start"]

log = logging.getLogger("timewheel.app.service")


class StartError(TimewheelError, RuntimeError):
    """The service cannot start: something it needs (ZooKeeper, ...) is unreachable; says which and what to do."""


def check_zookeeper_reachable(connect: str, timeout_s: float = 3.0) -> None:
    """Raise StartError unless some server of the ZooKeeper connect string accepts a connection."""
    servers = connect.split("/", 1)[0].split(",")
    problems = []
    for server in servers:
        host, _, port = server.strip().rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=timeout_s):
                return
        except (OSError, ValueError) as e:
            problems.append(f"{server.strip()}: {e}")
    raise StartError(f"cannot reach ZooKeeper at ha.zookeeper = {connect!r} ({'; '.join(problems)}): start it "
                     f"(`timewheel zookeeper` runs a local one) or fix the connect string")


def claim_data_dir(data_dir: Path, ha: "HAConfig", delay_topic: str) -> "ReplicaDataDir":
    """The data directory's replica identity (written at its first start with [ha]); StartError when it
    belongs to another replica. One that never stored anything is this replica's: a first start that
    ZooKeeper refused after the identity was written (its id live elsewhere, another shard count) left
    it, and the start again with the setting that refusal asked for must not be refused for it."""
    from coordination.identity import IDENTITY_FILE, ReplicaDataDir, ReplicaIdentityMismatch

    Path(data_dir).mkdir(parents=True, exist_ok=True)
    try:
        return ReplicaDataDir(data_dir, ha, delay_topic)
    except ReplicaIdentityMismatch as e:
        if not _stored_nothing(Path(data_dir), IDENTITY_FILE):
            raise StartError(str(e)) from e
        log.info("the data directory %s named another replica in %s but never stored anything: it is "
                 "replica %r's now", data_dir, IDENTITY_FILE, ha.replica_id)
    (Path(data_dir) / IDENTITY_FILE).unlink()
    try:
        return ReplicaDataDir(data_dir, ha, delay_topic)
    except ReplicaIdentityMismatch as e:
        raise StartError(str(e)) from e


def _stored_nothing(data_dir: Path, identity_file: str) -> bool:
    """Whether a replica's data directory never stored a message: its identity file names no queue
    read from and no gap, and it has no segment (what a first start refused before consuming leaves)."""
    from storage import parse_segment_name

    schedule = data_dir / "schedule"
    try:
        doc = json.loads((data_dir / identity_file).read_text())
        segments = [n for n in os.listdir(schedule) if parse_segment_name(n) is not None] if schedule.is_dir() else []
    except (OSError, ValueError):  # unreadable: the refusal says so
        return False
    return isinstance(doc, dict) and not doc.get("offsets") and not doc.get("gap") and not segments


def undo_failed_start(stop: Callable[[], None]) -> None:
    """Run `stop` for a start that failed; an error of its own is logged, never raised, so that the
    caller raises the start's error, the one that says what to fix."""
    try:
        stop()
    except Exception:
        log.critical("a failed start did not stop cleanly either (this error follows; the start's own is raised): "
                     "what the last checkpoint did not make durable is replayed from the ingest log at the next start",
                     exc_info=True)
