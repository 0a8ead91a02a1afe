"""The delivered-up-to watermark a lease holder publishes: what it passes, and what it names."""
from __future__ import annotations

import numpy as np

from timewheel import ManualClock
from timewheel._due import DueEntries
from timewheel.dispatch_queue import DispatchQueue
from timewheel.watermark import STRAGGLER_MS, delivered_up_to, delivered_up_to_except

T0 = 1_800_000_000_000


class _Timer:
    def __init__(self, released: int) -> None:
        self.released = released

    def released_up_to(self) -> int:
        return self.released


class _NoShaper:
    def earliest_held_due(self) -> int | None:
        return None


def _entries(due: list[int], refs: list[int]) -> DueEntries:
    n = len(due)
    return DueEntries(np.array(due, np.int64), np.array(refs, np.uint64), np.zeros(n, np.int16),
                      np.full(n, 7, np.int64), np.ones(n, np.uint16), np.array(refs, np.uint32))


def _origins(e: DueEntries) -> list[tuple[str, int] | None]:
    return [("broker-a:0", int(r)) for r in e.refs.tolist()]


def _queue(clock: ManualClock) -> DispatchQueue:
    return DispatchQueue(clock, batch_size=64, catch_up_chunk=64)


def test_a_message_that_arrived_past_due_is_named_instead_of_holding_the_watermark_back() -> None:
    """It waits in the dispatch queue (ready, then in a sender's hands) like any other; the mark
    passes it and lists it by origin, so a publication meanwhile moves W on. Before, W stayed just
    before its due time (60 s back) until it was sent, and under load every publication met one."""
    now = T0 + 100_000
    clock = ManualClock(now)
    timer, q = _Timer(now), _queue(clock)
    q.push_ready(_entries([now - 60_000, now - 3, now - 1], [1, 2, 3]))  # ref 1 arrived a minute late
    mark = delivered_up_to_except(timer, q, _NoShaper(), 64, _origins)
    assert mark.up_to == now - 3 - 1 and mark.exceptions == (("broker-a:0", 1, now - 60_000),)
    assert delivered_up_to(timer, q, _NoShaper()) == now - 60_000 - 1  # the plain watermark does not name it
    taken = q.take(64)
    assert taken is not None and len(taken[0].due) == 3
    mark = delivered_up_to_except(timer, q, _NoShaper(), 64, _origins)  # in a sender's hands now
    assert mark.up_to == now - 3 - 1 and mark.exceptions == (("broker-a:0", 1, now - 60_000),)
    q.clear_in_hand()
    assert delivered_up_to_except(timer, q, _NoShaper(), 64, _origins).up_to == now


def test_the_ordinary_traffic_of_the_last_moments_bounds_the_watermark_unnamed() -> None:
    now = T0 + 100_000
    clock = ManualClock(now)
    timer, q = _Timer(now), _queue(clock)
    q.push_ready(_entries([now - STRAGGLER_MS + 1, now], [5, 6]))
    mark = delivered_up_to_except(timer, q, _NoShaper(), 64, _origins)
    assert mark.up_to == now - STRAGGLER_MS and mark.exceptions == ()


def test_past_the_limit_the_next_straggler_bounds_the_watermark_and_unknown_origins_are_never_passed() -> None:
    now = T0 + 100_000
    clock = ManualClock(now)
    timer, q = _Timer(now), _queue(clock)
    q.push_backlog(_entries([now - 50_000 + i for i in range(10)], list(range(10, 20))))  # a catch-up backlog
    mark = delivered_up_to_except(timer, q, _NoShaper(), 4, _origins)
    assert mark.up_to == now - 50_000 + 4 - 1
    assert [e[1] for e in mark.exceptions] == [10, 11, 12, 13]

    def unknown_from_12(e: DueEntries) -> list[tuple[str, int] | None]:
        return [("broker-a:0", r) if r < 12 else None for r in e.refs.tolist()]

    mark = delivered_up_to_except(timer, q, _NoShaper(), 4, unknown_from_12)
    assert mark.up_to == now - 50_000 + 2 - 1 and [e[1] for e in mark.exceptions] == [10, 11]
