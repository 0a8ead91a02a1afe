"""The delivered-up-to watermark: the due time up to which every stored message has its outcome.

An entry leaves the timer (`TimerDriver.released_up_to`), waits in the dispatch queue (ready,
catch-up backlog, retries), is taken by a dispatch thread (in its hands until the pass ends), may
be held by the shaper, and is recorded. Every move keeps it visible in both places for a moment
(taken and held are registered before they leave the queue, retried entries return to the queue
before the thread lets go), so reading the timer, then the queue, then the shaper's holds, then the
queue again sees every entry not yet done, wherever it is. The watermark is just before the
earliest of them, and never past the timer's last pass.
"""
from __future__ import annotations

from typing import Protocol

from timewheel.dispatch_queue import DispatchQueue


class _Timer(Protocol):
    def released_up_to(self) -> int: ...


class _Dispatcher(Protocol):
    def earliest_held_due(self) -> int | None: ...


def delivered_up_to(timer: _Timer, queue: DispatchQueue, dispatcher: _Dispatcher) -> int:
    """Every entry due at or before the answer (epoch ms) is recorded as delivered, dead-lettered,
    cancelled or corrupt; -1 before the timer's first pass."""
    bound = timer.released_up_to()
    for earliest in (queue.earliest_due(), dispatcher.earliest_held_due(), queue.earliest_due()):
        if earliest is not None:
            bound = min(bound, earliest - 1)
    return bound
