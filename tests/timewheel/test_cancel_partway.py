"""A cancel whose dispatch-log write fails partway (a full disk on one segment): what it did
still holds, and the cancel, handed back or asked again, is applied again until it is whole."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from forwarder.config import RocketMQConfig
from forwarder.contract import ContractLimits
from forwarder.control import CANCEL_ID
from forwarder.ingest import DelayTopicIngest
from forwarder.rocketmq import ReceivedMessage
from storage import CANCELLED, ScheduleStore, StorageWriteError, TombstoneLog
from timewheel import Engine, ManualClock, Message
from timewheel.cancels import CancelRequest, Tombstones
from tests.timewheel.conftest import T0, MakeEngine, RecordingSink, drive

HOUR = 3_600_000
NEXT = T0 + HOUR  # the second segment


def _uniq(i: int) -> str:
    return f"{i:032X}"


def _disk_full_on(store: ScheduleStore, monkeypatch: pytest.MonkeyPatch, segment_ms: int) -> None:
    """Make recording CANCELLED in one segment's dispatch log fail as a full disk does."""
    real = store.record_dispatch

    def record_dispatch(seg: int, entries: np.ndarray, now: int, *args: Any, **kw: Any) -> None:
        if seg == segment_ms and (entries["outcome"] == CANCELLED).any():
            raise StorageWriteError(f"could not record {len(entries)} dispatch entries: No space left on device")
        real(seg, entries, now, *args, **kw)

    monkeypatch.setattr(store, "record_dispatch", record_dispatch)


def _outcomes(e: Engine, segment_ms: int) -> list[int]:
    assert e.store is not None
    return e.store.dispatch_log(segment_ms).entries["outcome"].tolist()


def test_a_cancel_by_id_that_failed_is_applied_when_asked_again_after_another_cancel(
        make_engine: MakeEngine, clock: ManualClock, sink: RecordingSink, monkeypatch: pytest.MonkeyPatch) -> None:
    """The admin caller asks again after an error; another cancel was applied in between."""
    e = make_engine()
    e.schedule([Message("T", b"a", NEXT + 10_000, msg_id=f"{_uniq(1)}:1")])
    assert e.store is not None
    _disk_full_on(e.store, monkeypatch, NEXT)
    with pytest.raises(StorageWriteError):
        e.apply_cancels([CancelRequest(_uniq(1), None, T0)])
    monkeypatch.undo()
    e.apply_cancels([CancelRequest("some-other-id", None, T0)])  # succeeds: saves its own tombstone
    assert e.apply_cancels([CancelRequest(_uniq(1), None, T0)]) == 1, "the retry was skipped as already seen"
    drive(e, clock, NEXT + 20_000)
    assert sink.sent == []
    assert _outcomes(e, NEXT) == [CANCELLED]


def test_a_key_cancel_over_two_segments_failing_on_the_second_is_made_whole_by_its_retry(
        make_engine: MakeEngine, clock: ManualClock, sink: RecordingSink, monkeypatch: pytest.MonkeyPatch) -> None:
    e = make_engine()
    e.schedule([Message("T", b"a", T0 + 10_000, keys=("k",), msg_id="m1"),
                Message("T", b"b", NEXT + 10_000, keys=("k",), msg_id="m2"),
                Message("T", b"c", T0 + 20_000, msg_id="other")])
    drive(e, clock, T0 + 1)  # the first segment is loaded: m1 and "other" are in the wheel
    assert e.store is not None
    _disk_full_on(e.store, monkeypatch, NEXT)
    with pytest.raises(StorageWriteError):
        e.apply_cancels([CancelRequest(None, "k", T0)])
    monkeypatch.undo()
    assert _outcomes(e, T0) == [CANCELLED], "the first segment's part is recorded"
    e.apply_cancels([CancelRequest("some-other-id", None, T0)])  # another cancel, applied in between
    assert e.apply_cancels([CancelRequest(None, "k", T0)]) == 1, "only m2 was left to cancel"
    assert e.stats().loaded_segments[str(T0)] == 1, "\"other\" is still outstanding in the first segment"
    drive(e, clock, NEXT + 20_000)
    assert [m for m, _ in sink.sent] == ["other"]
    assert _outcomes(e, T0).count(CANCELLED) == 1 and _outcomes(e, NEXT) == [CANCELLED]
    assert e.stats().counters.cancelled == 2


def test_a_retried_key_cancel_records_the_first_segment_once(
        make_engine: MakeEngine, clock: ManualClock, sink: RecordingSink, monkeypatch: pytest.MonkeyPatch) -> None:
    """Retried at once (the batch pulled again): the segment recorded before the failure is not
    recorded, nor counted off its segment's outstanding entries, a second time."""
    e = make_engine()
    e.schedule([Message("T", b"a", T0 + 10_000, keys=("k",), msg_id="m1"),
                Message("T", b"b", NEXT + 10_000, keys=("k",), msg_id="m2"),
                Message("T", b"c", T0 + 20_000, msg_id="other")])
    drive(e, clock, T0 + 1)
    assert e.store is not None
    _disk_full_on(e.store, monkeypatch, NEXT)
    with pytest.raises(StorageWriteError):
        e.apply_cancels([CancelRequest(None, "k", T0)])
    monkeypatch.undo()
    e.apply_cancels([CancelRequest(None, "k", T0)])
    assert e.stats().loaded_segments[str(T0)] == 1, "\"other\" is still outstanding in the first segment"
    drive(e, clock, NEXT + 20_000)
    assert [m for m, _ in sink.sent] == ["other"]
    assert _outcomes(e, T0).count(CANCELLED) == 1 and _outcomes(e, NEXT) == [CANCELLED]
    assert e.stats().counters.cancelled == 2


def _control(props: dict[str, str], n: int) -> ReceivedMessage:
    return ReceivedMessage("TW_DELAY", b"", "", "", f"C{n:031X}", dict(props), 0, 0, 0, n, T0 - 10, T0)


def test_a_control_batch_handed_back_after_a_failed_cancel_is_applied_when_pulled_again(
        make_engine: MakeEngine, clock: ManualClock, sink: RecordingSink, monkeypatch: pytest.MonkeyPatch) -> None:
    e = make_engine()
    e.schedule([Message("T", b"a", T0 + 10_000, msg_id=f"{_uniq(1)}:1"),
                Message("T", b"b", NEXT + 10_000, msg_id=f"{_uniq(2)}:1")])
    drive(e, clock, T0 + 1)
    ing = DelayTopicIngest(RocketMQConfig(namesrv="127.0.0.1:1"), ContractLimits(10**9, 1 << 20), clock.now_ms,
                           None)  # type: ignore[arg-type]  # no dead letter in these batches
    ing._schedule, ing._cancel = e.schedule, e.apply_cancels
    ing._accepting.set()
    batch = [_control({CANCEL_ID: _uniq(1)}, 1), _control({CANCEL_ID: _uniq(2)}, 2)]
    assert e.store is not None
    _disk_full_on(e.store, monkeypatch, NEXT)
    assert ing._on_batch(batch) is False, "handed back: pulled again"
    monkeypatch.undo()
    assert ing._on_batch([_control({CANCEL_ID: "some-other-id"}, 3)]) is True  # another queue's batch
    assert ing._on_batch(batch) is True  # pulled again: acknowledged
    drive(e, clock, NEXT + 20_000)
    assert sink.sent == []
    assert _outcomes(e, T0) == [CANCELLED] and _outcomes(e, NEXT) == [CANCELLED]


def test_saving_one_cancel_leaves_another_still_being_applied_off_the_disk(tmp_path: Any) -> None:
    """On disk a tombstone says its cancel was applied: a cancel saved by one caller does not
    write another's, still being applied (or failed), which would then be skipped as seen."""
    t = Tombstones(TombstoneLog(tmp_path), retention_ms=HOUR, max_entries=100)
    t.load(T0)
    a, b = CancelRequest("a", None, T0), CancelRequest("b", None, T0)
    assert t.add([a], T0) == [a]
    assert t.add([b], T0) == [b]
    t.save(T0, [b])
    assert [x.text for x in TombstoneLog(tmp_path).read().tombstones] == ["b"]
    assert t.add([a], T0) == [a] and t.add([b], T0) == []
    t.save(T0, [a])
    assert [x.text for x in TombstoneLog(tmp_path).read().tombstones] == ["b", "a"]
    t.close()


def test_a_copy_stored_while_its_cancel_arrived_is_cancelled_when_its_batch_comes_back(
        make_engine: MakeEngine, clock: ManualClock, sink: RecordingSink, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cancel arrives while its message is being stored (after the screen, before the store): it
    finds nothing stored, and the engine cancels the copy it stored itself right after. If that
    write fails, the batch is handed back, and its retry is screened as cancelled on arrival: the
    copy stored the first time is cancelled then, not sent."""
    e = make_engine()
    store = e.store
    assert store is not None
    msg = Message("T", b"a", NEXT + 10_000, msg_id=f"{_uniq(1)}:1")
    real_append = store.append

    def append_as_the_cancel_arrives(*a: Any, **kw: Any) -> Any:
        assert e.apply_cancels([CancelRequest(_uniq(1), None, T0)]) == 0  # nothing stored yet: acknowledged
        return real_append(*a, **kw)

    monkeypatch.setattr(store, "append", append_as_the_cancel_arrives)
    _disk_full_on(store, monkeypatch, NEXT)
    with pytest.raises(StorageWriteError):
        e.schedule([msg])  # stored, then the engine's own cancel of it fails: the batch goes back
    monkeypatch.undo()
    e.schedule([msg])  # pulled again: screened out as cancelled on arrival
    drive(e, clock, NEXT + 20_000)
    assert sink.sent == [], "a message whose cancel was acknowledged was sent"
    assert _outcomes(e, NEXT) == [CANCELLED]
