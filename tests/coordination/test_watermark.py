"""What a holder's mark covers: due by its watermark (never past the reader's clock) and below its
offset for the record's queue; unknown origins and marks without offsets by the watermark alone."""
from __future__ import annotations

import numpy as np
import pytest

from coordination.watermark import MalformedWatermark, Watermark, covered_by
from storage.origin import origin_rows

NAMES = ["broker-a:0", "broker-a:1"]


def _rows(queues: list[int], offsets: list[int]) -> np.ndarray:
    return origin_rows(np.array(queues, np.int32), np.array(offsets, np.int64))


def test_a_record_is_covered_only_below_the_holders_offset_for_its_queue() -> None:
    mark = Watermark(3, 1_000, "a", 0, {"broker-a:0": 10})
    due = np.array([900, 900, 900, 1_001, 900])
    origins = _rows([0, 0, 1, 0, -1], [9, 10, 0, 0, 123])
    # below the offset; at it (arrived after the mark); a queue the mark does not name; due after W;
    # unknown origin (watermark alone)
    assert covered_by([mark], due, origins, NAMES, 10_000).tolist() == [True, False, False, False, True]


def test_a_watermark_ahead_of_the_readers_clock_covers_only_up_to_that_clock() -> None:
    mark = Watermark(3, 5_000, "a", 0, {"broker-a:0": 100})
    due = np.array([1_900, 2_000, 2_001, 4_000])
    assert covered_by([mark], due, _rows([0] * 4, [1] * 4), NAMES, 2_000).tolist() == [True, True, False, False]


def test_marks_of_several_epochs_each_cover_what_their_holder_had() -> None:
    old = Watermark(1, 1_000, "a", 0, {"broker-a:0": 5})
    new = Watermark(2, 500, "b", 0, {"broker-a:0": 8})
    due = np.array([800, 400, 400])
    got = covered_by([old, new], due, _rows([0, 0, 0], [4, 7, 8]), NAMES, 10_000)
    assert got.tolist() == [True, True, False]


def test_a_mark_without_offsets_covers_by_its_watermark_alone() -> None:
    legacy = Watermark(1, 1_000, "a", 0, None)
    assert covered_by([legacy], np.array([1_000, 1_001]), _rows([0, 0], [99, 99]), NAMES, 10_000).tolist() == \
        [True, False]


def test_offsets_round_trip_and_a_malformed_document_is_refused_with_what_it_holds() -> None:
    mark = Watermark(2, 7, "b", 9, {"broker-a:1": 42})
    back = Watermark.from_json(mark.to_json())
    assert (back.epoch, back.watermark_ms, back.offsets) == (2, 7, {"broker-a:1": 42})
    with pytest.raises(MalformedWatermark, match="not a watermark"):
        Watermark.from_json(b'{"epoch": "x"}')


def test_a_record_listed_as_an_exception_is_not_covered_and_the_rest_below_w_is() -> None:
    mark = Watermark(3, 1_000, "a", 0, {"broker-a:0": 10, "broker-a:1": 10},
                     (("broker-a:0", 4, 500), ("broker-b:9", 1, 600)))
    due = np.array([500, 510, 520, 900])
    origins = _rows([0, 1, 0, 0], [4, 4, 5, 9])
    # listed (queue 0 offset 4); same offset on another queue; the next offset; a later one
    assert covered_by([mark], due, origins, NAMES, 10_000).tolist() == [False, True, True, True]
    # an earlier epoch's mark that covered it still does: that holder delivered it
    older = Watermark(2, 800, "b", 0, {"broker-a:0": 10})
    assert covered_by([older, mark], due, origins, NAMES, 10_000).tolist() == [True, True, True, True]


def test_exceptions_round_trip_and_a_mark_without_them_reads_as_before() -> None:
    mark = Watermark(2, 7, "b", 9, {"broker-a:1": 42}, (("broker-a:1", 40, 5),))
    assert Watermark.from_json(mark.to_json()).exceptions == (("broker-a:1", 40, 5),)
    legacy = b'{"epoch": 2, "watermark_ms": 7, "replica": "b", "published_ms": 9, "offsets": {"broker-a:1": 42}}'
    assert Watermark.from_json(legacy).exceptions == ()
    assert b"exceptions" not in Watermark(2, 7, "b", 9, {}).to_json()
    with pytest.raises(MalformedWatermark):
        Watermark.from_json(b'{"epoch": 2, "watermark_ms": 7, "replica": "b", "published_ms": 9, '
                            b'"exceptions": [["broker-a:1", 40]]}')


def test_an_entry_due_at_a_listed_due_time_is_not_covered_whatever_its_origin() -> None:
    """A message on the delay topic twice (a producer's retry to another queue) is stored by each
    replica from the copy it read first: the holder's listed copy may have another origin than this
    replica's. Both are due at the listed time. Before, this replica's copy was covered (due by W,
    below the offsets) and recorded as delivered though the holder had not sent the message."""
    mark = Watermark(3, 1_000, "a", 0, {"broker-a:0": 10, "broker-a:1": 10}, (("broker-a:1", 4, 500),))
    due = np.array([500, 500, 501])
    origins = _rows([0, 0, 0], [7, 8, 9])
    # the other copy (queue 0) of the listed message; another message due in that ms; one due a ms later
    assert covered_by([mark], due, origins, NAMES, 10_000).tolist() == [False, False, True]
    # a later mark of that holder that no longer lists it (sent meanwhile) covers them
    later = Watermark(3, 1_000, "a", 0, {"broker-a:0": 10, "broker-a:1": 10})
    assert covered_by([later], due, origins, NAMES, 10_000).tolist() == [True, True, True]
