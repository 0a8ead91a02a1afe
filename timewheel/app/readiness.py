"""Why a serving engine is not ready, and when it must exit for its supervisor (`serve`'s exit 3).

Each reason is a line an operator can act on: `/readyz` answers them with its 503, `timewheel status`
shows them under its headline, and `serve` logs the fatal one before it exits.
"""
from __future__ import annotations

from typing import Mapping, Protocol, Sequence

__all__ = ["must_stop", "not_ready_why"]


#: a dead thread's error is cut to this in a reason line (the log has it whole)
_ERROR_CHARS = 300


def _short(error: str) -> str:
    line = " ".join(error.split())  # one line: a reason is a line of /readyz and of `status`
    return line if len(line) <= _ERROR_CHARS else line[:_ERROR_CHARS - 1] + "…"


class _Engine(Protocol):
    def checkpoint_failure(self) -> str | None: ...


class _Rounds(Protocol):
    def not_ready_why(self) -> list[str]: ...


class _Replica(Protocol):
    @property
    def zookeeper_rounds(self) -> _Rounds: ...


class _ClockGuard(Protocol):
    def not_ready_why(self) -> list[str]: ...


def not_ready_why(engine: _Engine | None, consuming: bool, dead_threads: Sequence[str],
                  failures: Mapping[str, str] | None = None, replica: _Replica | None = None,
                  clock: _ClockGuard | None = None) -> list[str]:
    """Why the service is not ready (none: ready): not running, not consuming the delay topic yet,
    a thread that died (with the error that ended it, from `failures`), checkpoints that fail, with
    [ha] a `replica` whose ZooKeeper has failed its every round for longer than its session timeout,
    and sends held because the host's clock runs far ahead of the brokers' (`clock`, the clock check)."""
    if engine is None:
        return ["the engine is not running (starting or stopping)"]
    why = []
    if not consuming:
        why.append("the delay topic is not consumed yet (starting, or stopping)")
    if dead_threads:
        known = failures or {}
        named = ", ".join(f"{t} ({_short(known[t])})" if t in known else t for t in dead_threads)
        why.append(f"thread(s) died: {named} (the log has each one's traceback); serve exits 3 for its "
                   f"supervisor, and the restart reads again what they had not stored")
    failure = engine.checkpoint_failure()
    if failure is not None:
        why.append(f"checkpoints fail: {failure} (retried every checkpoint_seconds)")
    if replica is not None:  # it sends nothing and cannot take the lease over: a replica set short of one
        why += replica.zookeeper_rounds.not_ready_why()
    if clock is not None:  # nothing is lost, but nothing is delivered either until the clock is fixed
        why += clock.not_ready_why()
    return why


def must_stop(dead_threads: Sequence[str], checkpoints_stopped: str | None) -> str | None:
    """Why a serving process must exit with code 3 for a supervisor to restart it, None while it
    serves on. Every acknowledged message is in the store either way: staying up would deliver
    nothing a dead thread owned, and a store whose checkpoints stopped cannot let its log go."""
    if dead_threads:
        return (f"engine thread(s) {', '.join(dead_threads)} died (see the error above); stopping with exit code 3 so "
                f"that a supervisor restarts the engine")
    if checkpoints_stopped:
        return (f"{checkpoints_stopped}; stopping with exit code 3 so that a supervisor restarts the engine, which "
                f"replays the ingest log since the last checkpoint")
    return None
