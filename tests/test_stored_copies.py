"""The checkers' count: a second stored copy is a duplicate, the same copy again a redelivery."""
from __future__ import annotations

import threading
from dataclasses import dataclass

from tests.reliability.steady_load import SteadyLoad
from tests.stored_copies import StoredCopies


@dataclass(frozen=True)
class Copy:
    """Where a received message says the broker stored it."""

    queue_id: int
    queue_offset: int
    commit_log_offset: int
    store_timestamp: int


def test_the_same_copy_twice_is_a_redelivery_not_a_duplicate() -> None:
    c: StoredCopies[bytes] = StoredCopies()
    assert c.add(b"a", Copy(0, 5, 1000, 77))
    assert not c.add(b"a", Copy(0, 5, 1000, 77))
    assert c.copies(b"a") == 1
    assert (c.duplicates(), c.redeliveries()) == (0, 1)
    assert c.described() == ()


def test_a_second_position_is_a_duplicate_named_with_its_copies() -> None:
    c: StoredCopies[bytes] = StoredCopies()
    c.add(b"a", Copy(1, 9, 2000, 80))
    c.add(b"a", Copy(0, 5, 1000, 77))
    c.add(b"a", Copy(0, 5, 1000, 77))
    c.add(b"b", Copy(2, 3, 3000, 90))
    assert c.copies(b"a") == 2 and c.copies(b"b") == 1 and c.copies(b"z") == 0
    assert (c.duplicates(), c.redeliveries()) == (1, 1)
    assert c.described() == ("a: q0@5 stored 77, q1@9 stored 80",)
    # restricted to some keys, as a checker counts only what was acknowledged
    assert (c.duplicates([b"b", b"z"]), c.redeliveries([b"b", b"z"])) == (0, 0)


def test_two_brokers_copies_at_the_same_queue_position_are_two() -> None:
    c: StoredCopies[str] = StoredCopies()
    c.add("m", Copy(0, 5, 1000, 77))
    c.add("m", Copy(0, 5, 4000, 78))  # same queue id and offset on another broker
    assert c.duplicates() == 1


def test_described_stops_at_its_limit() -> None:
    c: StoredCopies[int] = StoredCopies()
    for k in range(8):
        c.add(k, Copy(0, k, k, 1))
        c.add(k, Copy(1, k, 100 + k, 2))
    assert len(c.described(limit=3)) == 3
    assert c.described([7])[0].startswith("7: ")


def test_counts_hold_under_concurrent_receipts() -> None:
    c: StoredCopies[int] = StoredCopies()

    def receive(offset: int) -> None:
        for k in range(2000):
            c.add(k, Copy(0, k, offset + k, 1))

    threads = [threading.Thread(target=receive, args=(o,)) for o in (0, 0, 10_000)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (c.duplicates(), c.redeliveries()) == (2000, 2000)


def test_the_steady_load_tally_counts_acknowledged_copies_only() -> None:
    load = SteadyLoad.__new__(SteadyLoad)  # the tally alone: no broker, no clients
    load._lock = threading.Lock()
    load._copies = StoredCopies()
    load._acked = {b"r-0", b"r-1", b"r-2"}
    load._copies.add(b"r-0", Copy(0, 1, 10, 5))
    load._copies.add(b"r-0", Copy(0, 1, 10, 5))  # handed over again
    load._copies.add(b"r-1", Copy(0, 2, 20, 6))
    load._copies.add(b"r-1", Copy(3, 7, 90, 9))  # stored twice
    load._copies.add(b"never-acked", Copy(0, 3, 30, 7))
    load._copies.add(b"never-acked", Copy(1, 3, 31, 7))
    t = load.tally()
    assert (t.acknowledged, t.delivered, t.lost, t.duplicates, t.redeliveries) == (3, 2, 1, 1, 1)
    assert t.duplicate_copies == ("r-1: q0@2 stored 6, q3@7 stored 9",)
