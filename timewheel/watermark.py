"""The delivered-up-to watermark: the due time up to which every stored message has its outcome.

An entry leaves the timer (`TimerDriver.released_up_to`), waits in the dispatch queue (ready,
catch-up backlog, retries), is taken by a dispatch thread (in its hands until the pass ends), may
be held by the shaper, and is recorded. Every move keeps it visible in both places for a moment
(taken and held are registered before they leave the queue, retried entries return to the queue
before the thread lets go), so reading the timer, then the queue, then the shaper's holds, then the
queue again sees every entry not yet done, wherever it is. The watermark is just before the
earliest of them, and never past the timer's last pass.

A replica holding a shard's lease publishes more (`delivered_up_to_except`): the few earliest
entries waiting for a retry (a broker refusing one topic, say), and those waiting to be sent more
than `STRAGGLER_MS` after they were due (a message that arrived already past due, a catch-up
backlog), are set apart as exceptions, named by their origin on the delay topic, and the watermark
passes them; one stuck or late message then no longer holds the watermark of the whole shard back.
Past `limit` exceptions, the next one bounds it again.

Both rely on every entry being in one of those places. A failure on the delivery path can leave
some in none: a timer pass that fails after taking records off its inbound list, a commit listener
that failed (the records never reached the timer), a dispatch pass that failed. The process then
stops not ready, but until it exits a watermark computed afresh could pass those entries, and a
standby taking over would skip them. So `Watermarks` checks for such a failure after each
computation, and from then on answers the last value computed before it (frozen).
"""
from __future__ import annotations

from typing import Callable, Protocol, Sequence

import numpy as np

from timewheel._due import DueEntries
from timewheel.dispatch_queue import DispatchQueue
from timewheel.gate import NO_WATERMARK, DeliveredMark, PendingEntry

#: entries that still wait this long (ms) after the timer released their due time are named with the
#: mark instead of holding it back; those due since then are the ordinary traffic of a send or two
STRAGGLER_MS = 250

#: the origins (queue name, offset) of due entries (by their locations), None where unknown
OriginsOf = Callable[[DueEntries], Sequence[tuple[str, int] | None]]


class _Timer(Protocol):
    def released_up_to(self) -> int: ...


class _Dispatcher(Protocol):
    def earliest_held_due(self) -> int | None: ...


class _FailingTimer(_Timer, Protocol):
    failed: bool


class _FailingDispatcher(_Dispatcher, Protocol):
    failed: bool


class _Store(Protocol):
    @property
    def commit_listener_failure(self) -> str | None: ...


def delivered_up_to(timer: _Timer, queue: DispatchQueue, dispatcher: _Dispatcher) -> int:
    """Every entry due at or before the answer (epoch ms) is recorded as delivered, dead-lettered,
    cancelled or corrupt; -1 before the timer's first pass."""
    bound = timer.released_up_to()
    for earliest in (queue.earliest_due(), dispatcher.earliest_held_due(), queue.earliest_due()):
        if earliest is not None:
            bound = min(bound, earliest - 1)
    return bound


def delivered_up_to_except(timer: _Timer, queue: DispatchQueue, dispatcher: _Dispatcher, limit: int,
                           origins_of: OriginsOf) -> DeliveredMark:
    """`delivered_up_to` passing the `limit` earliest entries waiting for a retry or due more than
    `STRAGGLER_MS` before the timer's last pass, which it lists by origin (an entry whose origin is
    unknown cannot be named to another replica: it bounds the watermark as before)."""
    bound = timer.released_up_to()
    late = bound - STRAGGLER_MS
    first, apart1 = queue.earliest_due_apart(limit, late)
    held = dispatcher.earliest_held_due()
    second, apart2 = queue.earliest_due_apart(limit, late)
    for earliest in (first, held, second):
        if earliest is not None:
            bound = min(bound, earliest - 1)
    # an entry may move between the two reads: what either set apart is set apart
    both = DueEntries.concat([apart1, apart2])
    _, at = np.unique(both.refs, return_index=True)
    apart = both.select(at)
    apart = apart.select(np.argsort(apart.due, kind="stable"))
    if len(apart.due) > limit:
        bound = min(bound, int(apart.due[limit]) - 1)
        apart = apart.select(slice(None, limit))
    apart = apart.select(apart.due <= bound)
    exceptions: list[PendingEntry] = []
    for d, origin in zip(apart.due.tolist(), origins_of(apart) if len(apart.due) else []):
        if origin is None:
            bound = min(bound, d - 1)
            break
        exceptions.append((origin[0], origin[1], d))
    return DeliveredMark(bound, tuple(e for e in exceptions if e[2] <= bound))


class Watermarks:
    """An engine's watermarks, frozen at the last values computed before a failure on the delivery path."""

    def __init__(self, timer: _FailingTimer, queue: DispatchQueue, dispatcher: _FailingDispatcher,
                 store: _Store) -> None:
        """The parts whose failure freezes them: the timer, the dispatcher and the store's commit listener."""
        self._timer, self._queue, self._dispatcher, self._store = timer, queue, dispatcher, store
        self._up_to = NO_WATERMARK
        self._mark = DeliveredMark(NO_WATERMARK)

    def failed(self) -> bool:
        """Whether a failure on the delivery path froze the watermarks."""
        return self._timer.failed or self._dispatcher.failed or self._store.commit_listener_failure is not None

    def up_to(self) -> int:
        """`delivered_up_to`, or its last value from before a failure."""
        bound = delivered_up_to(self._timer, self._queue, self._dispatcher)
        # checked after the reads: a failure is flagged before a mark published with it could cover what
        # it left out (a timer pass under the timer's lock; a listener before its commit returns and
        # the offsets published with the mark move past the records it missed)
        if self.failed():
            return self._up_to
        self._up_to = bound
        return bound

    def up_to_except(self, limit: int, origins_of: OriginsOf) -> DeliveredMark:
        """`delivered_up_to_except`, or its last mark from before a failure, `frozen`."""
        mark = delivered_up_to_except(self._timer, self._queue, self._dispatcher, limit, origins_of)
        if self.failed():
            return self._mark._replace(frozen=True)
        self._mark = mark
        return mark
