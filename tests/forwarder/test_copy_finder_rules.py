"""The copy finder's rules, with stand-ins for the brokers: "missing" only when every broker of the
topic answered and its index was proven by a sentinel; a broker down, unproven, or gone from the
route leaves keys unknown; a found copy is found whatever else failed."""
from __future__ import annotations

import uuid
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from forwarder.config import RocketMQConfig
from forwarder.copy_finder import BrokerCopyFinder
from forwarder.rocketmq import Copy, ConnectionFailedError, KeyLookup, OutgoingMessage, Receipt, SendStatus
from forwarder.rocketmq.errors import RemotingError
from storage import RecordBytes, ScheduleStore
from timewheel.message import Message

T = 1_800_000_000_000


class Brokers:
    """Two brokers holding copies by key; each can be down, or lose its sentinels."""

    def __init__(self) -> None:
        self.route = {"broker-a": "127.0.0.1:1", "broker-b": "127.0.0.1:2"}  # nothing listens: settings unknown
        self.held: dict[str, set[str]] = {"broker-a": set(), "broker-b": set()}
        self.down: set[str] = set()
        self.unindexed_sentinels: set[str] = set()  # brokers whose sentinel never shows up
        self.timeout = 1.0
        self.sentinels = 0

    # MessageLookup's part
    def brokers(self, topic: str) -> dict[str, str]:
        return dict(self.route)

    def lookup(self, topic: str, keys: Sequence[str], begin_ms: int, end_ms: int) -> dict[str, KeyLookup]:
        out = {}
        for k in keys:
            copies = tuple(Copy(b, 1, 5, 100, T) for b in sorted(self.route) if b not in self.down and k in self.held[b])
            errors = tuple(f"ConnectionFailedError: {b} down" for b in sorted(self.route) if b in self.down)
            out[k] = KeyLookup(k, copies, errors)
        return out

    # the sentinel producer's part
    def send_to_every_queue(self, message: OutgoingMessage) -> list[Receipt | RemotingError]:
        self.sentinels += 1
        out: list[Receipt | RemotingError] = []
        for b in sorted(self.route):
            if b in self.down:
                out.append(ConnectionFailedError(f"{b} down"))
                continue
            key = uuid.uuid4().hex
            if b not in self.unindexed_sentinels:
                self.held[b].add(key)
            out.append(Receipt(key, message.topic, b, 0, 1, SendStatus.OK))
        return out

    def close(self) -> None:
        pass


@pytest.fixture
def records(tmp_path: Path) -> RecordBytes:
    with ScheduleStore(tmp_path / "d") as store:
        loc = store.append([Message("T", f"m{i}".encode(), T + 1000).to_record(f"id-{i}") for i in range(4)],
                           T).locations
        return store.read_record_bytes(loc["segment_ms"].astype(np.int64), loc["part"].astype(np.int64),
                                       loc["offset"].astype(np.int64), loc["due_ms"].astype(np.int64))


def _finder(brokers: Brokers) -> BrokerCopyFinder:
    return BrokerCopyFinder(RocketMQConfig(), lambda: T + 5000, lookup=brokers, producer=brokers)  # type: ignore[arg-type]


def _keys(finder: BrokerCopyFinder, records: RecordBytes) -> list[str]:
    from forwarder.record_encoding import delivered_ids
    return delivered_ids(records, lambda k: [""] * k)


def test_found_and_missing_need_every_broker_and_a_proven_index(records: RecordBytes) -> None:
    brokers = Brokers()
    finder = _finder(brokers)
    keys = _keys(finder, records)
    brokers.held["broker-b"].add(keys[0])
    check = finder.find_copies(records, T, T + 4000)
    assert check.found.tolist() == [True, False, False, False] and not check.unknown.any()
    assert check.answers is not None and int(check.answers["queue_offset"][0]) == 5
    assert brokers.sentinels == 1
    finder.find_copies(records, T, T + 4000)
    assert brokers.sentinels == 1  # proven since those writes: no second sentinel
    finder.find_copies(records, T, T + 6000)
    assert brokers.sentinels == 2  # writes after the last proof: a new one


def test_a_broker_down_leaves_keys_unknown_but_a_copy_elsewhere_is_found(records: RecordBytes) -> None:
    brokers = Brokers()
    finder = _finder(brokers)
    keys = _keys(finder, records)
    brokers.held["broker-a"].add(keys[1])
    brokers.down.add("broker-b")
    check = finder.find_copies(records, T, T + 4000)
    assert check.found.tolist() == [False, True, False, False]
    assert check.unknown.tolist() == [True, False, True, True]
    assert check.errors is not None and "broker-b" in (check.errors[0] or "")


def test_a_sentinel_never_indexed_leaves_that_brokers_keys_unknown(records: RecordBytes,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import forwarder.copy_finder as cf
    monkeypatch.setattr(cf, "_BARRIER_TIMEOUT_S", 0.05)
    brokers = Brokers()
    brokers.unindexed_sentinels.add("broker-a")
    check = _finder(brokers).find_copies(records, T, T + 4000)
    assert check.unknown.all() and check.errors is not None and "not indexed" in (check.errors[0] or "")


def test_a_broker_gone_from_the_route_is_waited_for_not_taken_as_empty(records: RecordBytes) -> None:
    brokers = Brokers()
    finder = _finder(brokers)
    assert not finder.find_copies(records, T, T + 4000).unknown.any()
    del brokers.route["broker-b"]  # down long enough for the NameServer to drop it
    check = finder.find_copies(records, T, T + 4000)
    assert check.unknown.all() and "not in its route" in (check.errors[0] or "")  # type: ignore[index]


def test_a_broker_without_the_sentinel_topic_is_trusted_only_well_after_the_writes(records: RecordBytes) -> None:
    from forwarder.copy_finder import UNPROVEN_SETTLE_MS

    class NoSentinelOnB(Brokers):
        def brokers(self, topic: str) -> dict[str, str]:
            return {"broker-a": self.route["broker-a"]} if topic == "TW_SENTINEL" else dict(self.route)

        def send_to_every_queue(self, message: OutgoingMessage) -> list[Receipt | RemotingError]:
            return [r for r in super().send_to_every_queue(message) if isinstance(r, Receipt) and r.broker == "broker-a"]

    finder = _finder(NoSentinelOnB())  # its clock reads T + 5000
    soon = finder.find_copies(records, T, T + 5000 - UNPROVEN_SETTLE_MS + 1)
    assert soon.unknown.all() and "no queue there" in (soon.errors[0] or "")  # type: ignore[index]
    later = finder.find_copies(records, T, T + 5000 - UNPROVEN_SETTLE_MS)
    assert not later.unknown.any()
