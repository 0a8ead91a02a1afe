"""`MessageFinder`: each kind of message found by id and by key with its timeline, through the
engine's own meta store and read-only beside it (an in-memory sink stands in for the broker)."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import pytest

from storage import ANSWER_DTYPE, MetaStore
from timewheel import Engine, EngineConfig, ManualClock, Message
from timewheel.cancels import CancelRequest
from timewheel.app.cli_find import render
from timewheel.find import MessageFinder
from timewheel.message import SendResults
from tests.timewheel.conftest import T0, drive

UNIQ = {name: f"{i:032X}" for i, name in enumerate(["delivered", "by_id", "by_key", "dead", "retried", "pending"])}


class AnsweringSink:
    """Stores every message it is given, answers where (queue offsets from 100), except those whose
    body says how many attempts to fail first."""

    def __init__(self) -> None:
        self.failures: dict[str, int] = {}
        self.offset = 100

    def send_batch(self, messages: Sequence[Message]) -> list[bool]:
        ok: list[bool] = []
        errors: list[str | None] = []
        answers = np.zeros(len(messages), ANSWER_DTYPE)
        answers["queue_offset"] = -1
        for i, m in enumerate(messages):
            left = self.failures.get(m.body.decode(), 0)
            if left:
                self.failures[m.body.decode()] = left - 1
                ok.append(False)
                errors.append("BrokerBusyError: [TIMEOUT_CLEAN_QUEUE] broker busy")
                continue
            ok.append(True)
            errors.append(None)
            answers[i]["queue_offset"] = self.offset
            answers[i]["commit_offset"] = 4096 + self.offset
            answers[i]["store_ip"] = [127, 0, 0, 1]
            answers[i]["store_port"] = 10911
            answers[i]["queue_id"] = 2
            self.offset += 1
        return SendResults(ok, answers, errors)


@pytest.fixture
def engine(tmp_path: Path, clock: ManualClock) -> Iterator[Engine]:
    sink = AnsweringSink()
    sink.failures = {"retried": 1, "dead": 99}
    cfg = EngineConfig(data_dir=tmp_path / "data", max_attempts=3, retry_base_ms=100, retry_max_ms=200)
    e = Engine(cfg, sink, clock, seed=1).start(background=False)
    e.schedule([Message("ORDERS", name.encode(), T0 + (10_000 if name != "pending" else 7_200_000),
                        tags="t", keys=(f"order-{name}", "shared"), msg_id=f"{uniq}:0000abcd")
                for name, uniq in UNIQ.items()])
    e.apply_cancels([CancelRequest(UNIQ["by_id"], None, T0 - 2000), CancelRequest(None, "order-by_key", T0 - 1000)])
    drive(e, clock, T0 + 60_000)
    yield e
    e.stop()


def _one(found: object) -> dict:
    data = found.to_dict()  # type: ignore[attr-defined]
    assert data["count"] == 1, data
    return data["messages"][0]


def _whats(msg: dict) -> list[str]:
    return [s["what"] for s in msg["steps"]]


@pytest.mark.parametrize("how", ["id", "key"])
def test_every_kind_of_message_is_found_with_its_timeline(engine: Engine, clock: ManualClock, how: str) -> None:
    assert engine.store is not None
    finder = MessageFinder(engine.store.layout, engine.store.meta)
    now = clock.now_ms()
    find = (lambda name: finder.by_id(UNIQ[name], now)) if how == "id" else \
        (lambda name: finder.by_key(f"order-{name}", now))

    m = _one(find("delivered"))
    assert (m["state"], _whats(m), m["topic"], m["keys"]) == ("delivered", ["stored", "delivered"], "ORDERS",
                                                               ["order-delivered", "shared"])
    delivered = m["steps"][1]
    assert delivered["broker_msg_id"].startswith("7F00000100002A9F") and delivered["queue_offset"] >= 100
    assert delivered["attempt"] == 1 and delivered["at_ms"] == T0 + 10_000

    m = _one(find("by_id"))
    assert (m["state"], _whats(m)) == ("cancelled", ["stored", "cancel_received", "cancelled"])
    assert m["steps"][1]["by"] == "id" and m["steps"][1]["at_ms"] == T0 - 2000

    m = _one(find("by_key"))
    assert (m["state"], _whats(m)) == ("cancelled", ["stored", "cancel_received", "cancelled"])
    assert m["steps"][1]["key"] == "order-by_key"

    m = _one(find("dead"))
    assert (m["state"], _whats(m)) == ("dead_lettered", ["stored", "send_failed", "send_failed", "dead_lettered"])
    assert "TIMEOUT_CLEAN_QUEUE" in m["steps"][1]["error"]
    assert m["steps"][-1]["reason"].startswith("not delivered after 3 attempts; last error: BrokerBusyError")

    m = _one(find("retried"))
    assert (m["state"], _whats(m)) == ("delivered", ["stored", "send_failed", "delivered"])
    assert m["steps"][2]["attempt"] == 2

    m = _one(find("pending"))
    assert (m["state"], _whats(m)) == ("pending", ["stored", "pending"])
    assert "waits for its due time" in m["steps"][-1]["note"]


def test_a_key_shared_by_many_answers_at_most_the_limit(engine: Engine, clock: ManualClock) -> None:
    assert engine.store is not None
    finder = MessageFinder(engine.store.layout, engine.store.meta)
    found = finder.by_key("shared", clock.now_ms(), limit=4)
    assert (len(found.trails), found.truncated) == (4, True)
    assert (len(finder.by_key("shared", clock.now_ms(), limit=6).trails), found.truncated) == (6, True)
    assert finder.by_key("nobody", clock.now_ms()).to_dict()["count"] == 0


def test_beside_a_running_engine_it_finds_what_is_not_flushed_yet(tmp_path: Path, clock: ManualClock) -> None:
    cfg = EngineConfig(data_dir=tmp_path / "data")
    e = Engine(cfg, AnsweringSink(), clock, seed=1).start(background=False)
    try:
        e.schedule([Message("ORDERS", b"x", T0 + 5000, keys=("order-9",), msg_id=f"{UNIQ['pending']}:00000001")])
        # the engine's meta store holds the location in memory only: a read-only reader cannot see it
        assert e.store is not None
        ro = MetaStore(e.store.layout.meta_dir, read_only=True)
        assert ro.locations([f"{UNIQ['pending']}:00000001"]) == [None]
        ro.close()
        with MessageFinder.beside_engine(tmp_path / "data") as finder:
            assert [t.msg_id for t in finder.by_id(UNIQ["pending"], T0).trails] == [f"{UNIQ['pending']}:00000001"]
            assert finder.by_key("order-9", T0).trails[0].state == "pending"
        drive(e, clock, T0 + 6000)
        e.store.checkpoint()  # now flushed: found through the meta store
        with MessageFinder.beside_engine(tmp_path / "data") as finder:
            assert finder.by_key("order-9", T0 + 6000).trails[0].state == "delivered"
    finally:
        e.stop()


def test_a_standby_shows_what_the_lease_holder_delivered(tmp_path: Path, clock: ManualClock) -> None:
    from storage import DELIVERED, dispatch_entries

    e = Engine(EngineConfig(data_dir=tmp_path / "data"), AnsweringSink(), clock, seed=1).start(background=False)
    try:
        e.schedule([Message("ORDERS", b"x", T0 + 5000, keys=("order-1",), msg_id=f"{UNIQ['delivered']}:00000001")])
        assert e.store is not None
        seg = e.store.layout.segment_start(T0 + 5000)
        ix = e.store.segment_index(seg)
        # what the dispatcher records for a record due by the holder's watermark: attempts 0
        e.store.record_dispatch(seg, dispatch_entries(ix.part, ix.offset, ix.due_ms, T0 + 6000, DELIVERED, 0), T0 + 6000)
        m = _one(MessageFinder(e.store.layout, e.store.meta).by_key("order-1", T0 + 7000))
        assert (m["state"], _whats(m)) == ("delivered", ["stored", "delivered_by_lease_holder"])
    finally:
        e.stop()


def test_a_message_delivered_after_a_cancel_was_recorded_says_delivered(tmp_path: Path, clock: ManualClock) -> None:
    # A standby records a cancel read after the message came due (CANCELLED) while the lease holder
    # had delivered it (DELIVERED, attempts 0, recorded after): it went out, and that is its state.
    from storage import CANCELLED, DELIVERED, dispatch_entries

    e = Engine(EngineConfig(data_dir=tmp_path / "data"), AnsweringSink(), clock, seed=1).start(background=False)
    try:
        e.schedule([Message("ORDERS", b"x", T0 + 5000, keys=("order-1",), msg_id=f"{UNIQ['delivered']}:00000001")])
        assert e.store is not None
        seg = e.store.layout.segment_start(T0 + 5000)
        ix = e.store.segment_index(seg)
        for at, outcome in ((T0 + 6000, CANCELLED), (T0 + 6500, DELIVERED)):
            e.store.record_dispatch(seg, dispatch_entries(ix.part, ix.offset, ix.due_ms, at, outcome, 0), at)
        m = _one(MessageFinder(e.store.layout, e.store.meta).by_key("order-1", T0 + 7000))
        assert m["state"] == "delivered", _whats(m)
    finally:
        e.stop()


def test_a_message_retired_after_the_view_was_taken_is_not_found_rather_than_corrupt(tmp_path: Path,
                                                                                 clock: ManualClock) -> None:
    e = Engine(EngineConfig(data_dir=tmp_path / "data"), AnsweringSink(), clock, seed=1).start(background=False)
    try:
        e.schedule([Message("ORDERS", b"x", T0 + 5000, keys=("order-old",), msg_id=f"{UNIQ['delivered']}:00000001")])
        drive(e, clock, T0 + 3 * 3_600_000)  # delivered, and its segment left behind
        assert e.store is not None
        e.store.checkpoint()  # its location flushed: a read-only view sees it
        with MessageFinder.beside_engine(tmp_path / "data") as finder:  # a view taken before retention ran
            assert e.store.retire(clock.now_ms(), 3_600_000) == [e.store.layout.segment_start(T0)]
            assert finder.meta.locations([f"{UNIQ['delivered']}:00000001"]) != [None]  # the view still names it
            assert finder.by_key("order-old", clock.now_ms()).to_dict()["count"] == 0
            assert finder.by_id(UNIQ["delivered"], clock.now_ms()).to_dict()["count"] == 0
        assert MessageFinder(e.store.layout, e.store.meta).by_key("order-old", clock.now_ms()).trails == []
    finally:
        e.stop()


def test_a_message_caught_between_its_ingest_log_frame_and_its_part_write_is_not_called_corrupt(
        tmp_path: Path, clock: ManualClock, monkeypatch: pytest.MonkeyPatch) -> None:
    """A commit writes the ingest log first, then the part: a look-up beside the engine in between
    finds the record in the log (and its part not holding it yet) and reads it from the log."""
    e = Engine(EngineConfig(data_dir=tmp_path / "data"), AnsweringSink(), clock, seed=1).start(background=False)
    try:
        assert e.store is not None
        seen: list[dict] = []
        write = e.store.writer.write

        def look_then_write(*args: object) -> None:  # the engine is between the two writes of its commit
            with MessageFinder.beside_engine(tmp_path / "data") as finder:
                seen.extend(_one(f) for f in (finder.by_key("order-7", T0), finder.by_id(UNIQ["pending"], T0)))
            write(*args)  # type: ignore[arg-type]

        monkeypatch.setattr(e.store.writer, "write", look_then_write)
        e.schedule([Message("ORDERS", b"xyz", T0 + 5000, keys=("order-7",), msg_id=f"{UNIQ['pending']}:00000007")])
        assert len(seen) == 2  # by key and by id
        for m in seen:
            assert (m["state"], _whats(m)) == ("pending", ["stored", "pending"]), m
            assert (m["topic"], m["keys"], m["body_bytes"], m["due_ms"]) == ("ORDERS", ["order-7"], 3, T0 + 5000)
    finally:
        e.stop()


@pytest.mark.parametrize("how", ["id", "key"])
def test_a_message_whose_cancel_came_first_is_not_found_but_its_cancel_is(engine: Engine, clock: ManualClock,
                                                                         how: str) -> None:
    # cancelled on arrival: never stored; "no stored message" alone would read as lost
    uniq = "C0A80001000000000000000000000099"
    engine.apply_cancels([CancelRequest(uniq, None, T0)] if how == "id" else [CancelRequest(None, "order-early", T0)])
    engine.schedule([Message("ORDERS", b"early", T0 + 90_000, keys=("order-early",), msg_id=f"{uniq}:0000abcd")])
    assert engine.stats().counters.cancelled_on_arrival == 1
    assert engine.store is not None
    finder = MessageFinder(engine.store.layout, engine.store.meta)
    found = finder.by_id(uniq, clock.now_ms()) if how == "id" else finder.by_key("order-early", clock.now_ms())
    data = found.to_dict()
    assert data["count"] == 0 and [c["what"] for c in data["cancels"]] == ["cancel_received"], data
    assert data["cancels"][0]["by"] == how and data["cancels"][0]["kept_until_ms"] > clock.now_ms()
    text = render(data)
    assert "cancelled on arrival" in text and "cancel by" in text, text


def test_nothing_stored_and_no_cancel_says_not_found_alone(engine: Engine, clock: ManualClock) -> None:
    assert engine.store is not None
    data = MessageFinder(engine.store.layout, engine.store.meta).by_key("order-never", clock.now_ms()).to_dict()
    assert data["count"] == 0 and data["cancels"] == []
    assert render(data).startswith("no stored message with key 'order-never'. ")


def test_a_failed_reopen_of_the_meta_store_is_tried_again_by_the_next_look_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint moved the engine on during a look-up and the fresh view of its meta store could not be
    opened: that look-up fails with the open's own error, and the next one opens the store again (it
    used the store already closed, failing with words about a closed store, every time after)."""
    import timewheel.find as find
    from storage import SnapshotMovedError, StorageError
    from tests.storage._meta_damage import NOW, stored

    d = stored(tmp_path)
    holding = find.records_holding
    moved = [1]

    def moves_once(*args: object) -> object:  # the engine's checkpoint removed the log file being read
        if moved:
            moved.pop()
            raise SnapshotMovedError("the ingest log moved on")
        return holding(*args)  # type: ignore[arg-type]

    refusals = ["the disk is gone", "the disk is still gone"]

    def opens(*args: object, **kw: object) -> MetaStore:
        if refusals:
            raise StorageError(refusals.pop(0))
        return MetaStore(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(find, "records_holding", moves_once)
    with MessageFinder.beside_engine(d) as finder:
        monkeypatch.setattr(find, "MetaStore", opens)
        with pytest.raises(StorageError, match="the disk is gone"):
            finder.by_key("k", NOW)
        with pytest.raises(StorageError, match="the disk is still gone"):  # tried again, its own words again
            finder.by_id("m0", NOW)
        assert sorted(t.msg_id for t in finder.by_key("k", NOW).trails) == ["m0", "m1", "m2"]
    assert refusals == []
