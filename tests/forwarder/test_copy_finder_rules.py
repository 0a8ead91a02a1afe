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


# ---- brokers remembered across a restart (the data directory's dedupe-brokers.txt) ---------------------------

def _restartable(brokers: Brokers, data_dir: Path) -> BrokerCopyFinder:
    return BrokerCopyFinder(RocketMQConfig(), lambda: T + 5000, data_dir=data_dir,
                            lookup=brokers, producer=brokers)  # type: ignore[arg-type]


def test_a_broker_seen_before_a_restart_and_gone_from_the_route_now_leaves_keys_unknown(records: RecordBytes,
                                                                                      tmp_path: Path) -> None:
    brokers = Brokers()
    before = _restartable(brokers, tmp_path / "d")
    assert not before.find_copies(records, T, T + 4000).unknown.any()  # broker-a and broker-b both answered
    brokers.held["broker-b"].add(_keys(before, records)[0])  # a copy stored on broker-b before the crash
    del before  # the engine crashed
    del brokers.route["broker-b"]  # killed: the NameServer drops it from the route at once
    after = _restartable(brokers, tmp_path / "d")  # started again over the same data directory
    check = after.find_copies(records, T, T + 4000)
    assert not check.found.any() and check.unknown.all(), "broker-b may hold copies: never missing"
    assert check.errors is not None and "broker broker-b served T" in (check.errors[0] or "")
    assert "dedupe-brokers.txt" in (check.errors[0] or ""), "the error says how to forget a broker gone for good"


def test_a_broker_the_delivery_sent_through_before_a_restart_is_waited_for(records: RecordBytes,
                                                                          tmp_path: Path) -> None:
    from forwarder.delivery import RocketMQSink
    from tests.forwarder.rocketmq.test_producer import FakeServer

    server = FakeServer(routes={"T": 2})  # NameServer and a broker named "b"
    sink = RocketMQSink(RocketMQConfig(namesrv=server.addr), producer=None)  # type: ignore[arg-type]
    BrokerCopyFinder(RocketMQConfig(), lambda: T + 5000, lookup=Brokers(), producer=Brokers(),  # type: ignore[arg-type]
                     data_dir=tmp_path / "d", delivery=sink)  # as the service builds it
    try:
        assert sink.send_batch([Message("T", b"x", T)]) == [True]  # no look-up in this run, only a delivery
    finally:
        sink.close()
        server.close()
    after = _restartable(Brokers(), tmp_path / "d")  # b is down now: the route lists broker-a and broker-b only
    check = after.find_copies(records, T, T + 4000)
    assert check.unknown.all() and "broker b served T" in (check.errors[0] or "")  # type: ignore[index]


def test_a_remembered_broker_an_operator_removed_is_forgotten_at_the_next_look_up(records: RecordBytes,
                                                                                tmp_path: Path) -> None:
    brokers = Brokers()
    finder = _restartable(brokers, tmp_path / "d")
    finder.find_copies(records, T, T + 4000)
    del brokers.route["broker-b"]
    assert finder.find_copies(records, T, T + 4000).unknown.all()
    memory = tmp_path / "d" / "dedupe-brokers.txt"
    lines = memory.read_text().splitlines()
    assert lines[0].startswith("#") and '["broker-b", "T"]' in lines
    memory.write_text("\n".join(line for line in lines if not line.startswith('["broker-b"')) + "\n")  # gone for good
    check = finder.find_copies(records, T, T + 4000)
    assert not check.unknown.any() and not check.found.any()  # missing: sent
    assert '["broker-b", "T"]' not in memory.read_text()


def test_an_unreadable_memory_of_brokers_leaves_keys_unknown_naming_the_file(records: RecordBytes,
                                                                             tmp_path: Path) -> None:
    (tmp_path / "d" / "dedupe-brokers.txt").write_text('["broker-b", "T"\n')  # a hand edit gone wrong
    brokers = Brokers()
    check = _restartable(brokers, tmp_path / "d").find_copies(records, T, T + 4000)
    assert check.unknown.all() and "dedupe-brokers.txt" in (check.errors[0] or "")  # type: ignore[index]
    assert (tmp_path / "d" / "dedupe-brokers.txt").read_text() == '["broker-b", "T"\n', "left for the operator to mend"


def test_the_memory_is_written_only_when_a_broker_is_new(records: RecordBytes, tmp_path: Path) -> None:
    finder = _restartable(Brokers(), tmp_path / "d")
    finder.find_copies(records, T, T + 4000)
    memory = tmp_path / "d" / "dedupe-brokers.txt"
    first = memory.stat().st_mtime_ns, memory.stat().st_ino
    finder.note_route("T", ["broker-a", "broker-b"])
    finder.find_copies(records, T, T + 4000)
    assert (memory.stat().st_mtime_ns, memory.stat().st_ino) == first
    finder.note_route("T", ["broker-c"])
    assert '["broker-c", "T"]' in memory.read_text().splitlines()
