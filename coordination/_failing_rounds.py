"""A replica's rounds that ZooKeeper failed in a row: what `status` shows, and past a session why it is not ready.

Each round of the replica's loop (`ShardReplica._contend`) either completes or fails: a request
refused or dropped, or no connection to make one on. A failed round stops sending, and the next one
tries again, which is right for a blip. A failure that lasts (an ACL changed under the shard, the
ensemble out of reach) keeps a replica from ever sending or taking over: its status names the last
failure, since when and how many rounds, from the first failure on; once that has lasted longer
than the session timeout ZooKeeper granted (a blip never does: the session survives it), the service
is not ready, with `ZooKeeperFailingError`'s words. The first round that completes clears it.

A run logs its first failure with its traceback, then again only when the error says something
else or `REPEAT_S` went by (with how many rounds and for how long): a failure that lasts (an ACL
that refuses the watermark, say) fails every round, one to six a second, and a traceback each would
bury everything else in the log. So would the lease taken and lost each round, which the replica
then leaves to this run's lines (`transition_level`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from kazoo.exceptions import KazooException
from kazoo.handlers.threading import KazooTimeoutError

from coordination.errors import ZooKeeperFailingError, one_line
from coordination.fencing import FencingDeadline
from timewheel.failure_log import REPEAT_S, RepeatedFailureLog

__all__ = ["ZOOKEEPER_ERRORS", "FailingRounds"]

log = logging.getLogger("timewheel.replica")

#: what a round's ZooKeeper requests raise when ZooKeeper refuses or drops them
ZOOKEEPER_ERRORS = (KazooException, KazooTimeoutError, ConnectionError, OSError)
#: a failure's text is cut to this in `status` (the log has it whole)
_ERROR_CHARS = 300


@dataclass(frozen=True)
class _Run:
    """The failed rounds in a row so far."""

    since: float  # monotonic, the first of them
    since_ms: int  # epoch ms, the same
    rounds: int
    last: BaseException | str


def _text(last: BaseException | str) -> str:
    text = one_line(last) if isinstance(last, BaseException) else last
    return text if len(text) <= _ERROR_CHARS else text[:_ERROR_CHARS - 1] + "…"


class FailingRounds:
    """The run of failed rounds of one replica (none while its rounds complete)."""

    def __init__(self, zookeeper: str, replica_id: str, path: str, fence: FencingDeadline,
                 now_ms: Callable[[], int], monotonic: Callable[[], float]) -> None:
        """`fence` holds the granted session timeout, which a run must outlast to make the service not ready."""
        self._zookeeper, self._replica_id, self._path = zookeeper, replica_id, path
        self._fence, self._now_ms, self._monotonic = fence, now_ms, monotonic
        # replaced whole by the replica's thread, read whole by the admin's: no lock needed
        self._run: _Run | None = None
        self._this_round_failed = False
        self._failures = RepeatedFailureLog(log, monotonic)  # the run's ZooKeeper errors, as logged
        self._transitions = 0  # the lease taken or lost during the run

    def failed(self, why: BaseException | str) -> None:
        """This round failed: a ZooKeeper error (logged here, with its traceback, unless the run logged
        the same error less than `REPEAT_S` ago) or why no request was made."""
        self._this_round_failed = True
        run = self._run
        now = self._monotonic()
        if run is None:
            run = self._run = _Run(now, self._now_ms(), 1, why)
            self._transitions = 0
        else:
            run = self._run = _Run(run.since, run.since_ms, run.rounds + 1, why)
        if isinstance(why, BaseException):
            more = "" if run.rounds == 1 else f" ({run.rounds} rounds in a row over {now - run.since:.0f} s)"
            self._failures.failed(why, "lease of shard %s: ZooKeeper request failed; not sending until it answers",
                                  self._path, note=more)

    def end_round(self) -> None:
        """A round ended: one that did not fail ends the run."""
        run, failed, self._this_round_failed = self._run, self._this_round_failed, False
        if run is not None and not failed:
            self._run = None
            self._failures.end()
            log.info("lease of shard %s: ZooKeeper answers again after %d failed round(s) over %.1f s (the last: %s)",
                     self._path, run.rounds, self._monotonic() - run.since, _text(run.last))

    def transition_level(self) -> int:
        """The level to log the lease taken or lost at (ask once for each): WARNING, but DEBUG from the third
        within one run of failed rounds while the run's failure was logged less than `REPEAT_S` ago (a
        holder whose watermark write is refused takes the lease and loses it every round; the run's line,
        with its count, says so for them). The loss at a run's start and the take-over at its end are told."""
        if self._run is None:
            return logging.WARNING
        self._transitions += 1
        quiet = self._transitions > 2 and self._failures.logged_within()
        return logging.DEBUG if quiet else logging.WARNING

    def status(self) -> dict[str, object]:
        """Since when (epoch ms), how many rounds and the last failure, one line; None, 0, None while none fails."""
        run = self._run
        if run is None:
            return {"zookeeper_failing_since_ms": None, "zookeeper_failed_rounds": 0, "zookeeper_last_error": None}
        return {"zookeeper_failing_since_ms": run.since_ms, "zookeeper_failed_rounds": run.rounds,
                "zookeeper_last_error": _text(run.last)}

    def not_ready_why(self) -> list[str]:
        """The reason not to be ready once the run has lasted longer than the granted session timeout."""
        run = self._run
        if run is None:
            return []
        failing_s = self._monotonic() - run.since
        if failing_s <= self._fence.session_timeout_s:
            return []
        return [str(ZooKeeperFailingError(self._zookeeper, self._replica_id, self._path, failing_s, run.rounds,
                                          run.last))]
