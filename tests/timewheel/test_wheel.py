"""TimeWheel against the heapq ReferenceWheel, plus its edge cases, validation and memory bound."""

from __future__ import annotations

import doctest

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import timewheel.wheel as wheel_module
from tests.timewheel.reference import ReferenceWheel
from timewheel.wheel import ADDED, BEYOND, EXPIRED, TimeWheel, _stable_argsort


class TinyWheel(TimeWheel):
    """Knobs shrunk so that a few dozen entries reach chunks, staging overflow, merges and radix."""

    _CHUNK_ENTRIES = 3
    _STAGING_MAX = 4
    _MERGE_CAP = 16
    _MAX_RUNS = 3
    _RADIX_MIN = 0


# (tick_ms, slots): tiny wheels force slot boundaries, the horizon and rotations; then the
# production shape, a span beyond 2**32 ms (comparison-sort fallback), and more than 65536 slots
# (two radix passes).
GEOMETRIES = [(1, 3), (7, 5), (1, 1), (3, 2), (10, 64), (500, 16384), (10**6, 10**4), (1, 70_000)]
REFS = st.integers(0, 40) | st.sampled_from([2**63, 2**64 - 1])


def arrays(pairs: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """(due, ref) pairs as the int64 and uint64 arrays add() takes."""
    return (
        np.array([d for d, _ in pairs], dtype=np.int64),
        np.array([r for _, r in pairs], dtype=np.uint64),
    )


def assert_same_state(w: TimeWheel, ref: ReferenceWheel) -> None:
    """Everything observable agrees, and the wheel's own audit finds nothing."""
    assert w.check() == []
    assert len(w) == len(ref)
    assert w.next_due_ms() == ref.next_due_ms()
    assert (w.time_ms, w.cursor_ms, w.horizon_ms) == (ref.time_ms, ref.cursor_ms, ref.horizon_ms)
    assert w.nbytes <= 20 * len(w)


def assert_same_release(got: tuple[np.ndarray, np.ndarray], want: tuple[np.ndarray, np.ndarray]) -> None:
    """Same entries in the same order, with the documented dtypes."""
    assert got[0].dtype == np.int64 and got[1].dtype == np.uint64
    assert got[0].tolist() == want[0].tolist()
    assert got[1].tolist() == want[1].tolist()


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    geometry=st.sampled_from(GEOMETRIES),
    tiny=st.booleans(),
    start=st.integers(-(10**6), 10**6),
    data=st.data(),
)
def test_wheel_matches_reference(geometry, tiny, start, data):
    """Random bulk adds, pops at non-decreasing times, removes: the wheel behaves as the heap."""
    tick, slots = geometry
    span = tick * slots
    w = (TinyWheel if tiny else TimeWheel)(tick_ms=tick, slots=slots, start_ms=start)
    ref = ReferenceWheel(tick_ms=tick, slots=slots, start_ms=start)
    near = st.integers(-2 * tick - 1, 2 * tick + 1)  # slot boundaries around the cursor
    wide = st.integers(-span // 4 - 2, span + span // 4 + 2)  # up to and past the horizon
    for _ in range(data.draw(st.integers(1, 40), label="steps")):
        op = data.draw(st.sampled_from(["add", "add", "bulk", "pop", "pop", "pop", "remove"]))
        if op in ("add", "bulk"):
            low, high = (0, 5) if op == "add" else (6, 60)
            offsets = data.draw(st.lists(near | wide, min_size=low, max_size=high), label="due")
            pairs = [(w.time_ms + o, data.draw(REFS)) for o in offsets]
            due, refs = arrays(pairs)
            assert w.add(due, refs).tolist() == ref.add(due, refs).tolist()
        elif op == "pop":
            delta = data.draw(
                st.integers(0, 2 * tick) | st.integers(0, 2 * span) | st.integers(-3, 0),
                label="delta",
            )
            now = w.time_ms - 1 + delta
            assert_same_release(w.pop_due(now), ref.pop_due(now))
            if len(w):
                assert w.next_due_ms() > now
        else:
            gone = np.array(data.draw(st.lists(REFS, max_size=4)), dtype=np.uint64)
            assert w.remove(gone) == ref.remove(gone)
        assert_same_state(w, ref)
    final = w.horizon_ms + span  # past everything held: one jump drains the wheel
    assert_same_release(w.pop_due(final), ref.pop_due(final))
    assert len(w) == 0 and w.nbytes == 0 and w.next_due_ms() is None


@settings(max_examples=200, deadline=None)
@given(
    due=hnp.arrays(np.int64, st.integers(0, 400), elements=st.integers(0, 3_600_000)),
    stops=st.lists(st.integers(0, 3_600_000), max_size=20),
)
def test_bulk_load_releases_in_due_then_insertion_order(due, stops):
    """A segment-sized load (an hour at 500 ms) released at random times, vs a stable sort."""
    w = TinyWheel(tick_ms=500, slots=7200 + 1)
    refs = np.arange(len(due), dtype=np.uint64)
    assert not w.add(due, refs).any()
    order = np.argsort(due, kind="stable")
    got_due, got_refs = [], []
    for now in sorted(stops) + [3_600_000]:
        d, r = w.pop_due(now)
        assert (d <= now).all()
        got_due += d.tolist()
        got_refs += r.tolist()
        assert w.check() == []
    assert got_due == due[order].tolist()
    assert got_refs == refs[order].tolist()


def test_worked_example_in_the_class_comment():
    """The docstring's example runs as written."""
    result = doctest.testmod(wheel_module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 8 and result.failed == 0


def test_status_constants():
    """The statuses are distinct small ints, usable against the uint8 status array."""
    assert (ADDED, EXPIRED, BEYOND) == (0, 1, 2)


def test_mid_slot_pop_releases_only_what_is_due():
    """Millisecond precision: inside a 500 ms slot, release at the entry's own millisecond."""
    w = TimeWheel(tick_ms=500, slots=16, start_ms=0)
    w.add(np.array([1_003, 1_001, 1_499, 1_001], dtype=np.int64), np.arange(4, dtype=np.uint64))
    assert w.pop_due(1_000)[0].tolist() == []
    assert w.next_due_ms() == 1_001
    d, r = w.pop_due(1_001)
    assert d.tolist() == [1_001, 1_001] and r.tolist() == [1, 3]
    assert w.pop_due(1_002)[0].tolist() == []
    assert w.pop_due(1_498)[0].tolist() == [1_003]
    assert w.next_due_ms() == 1_499
    assert w.pop_due(1_499)[0].tolist() == [1_499]
    assert len(w) == 0 and w.next_due_ms() is None


def test_smaller_now_returns_nothing_and_changes_nothing():
    """pop_due with a time before the wheel's is a no-op, not a rewind."""
    w = TimeWheel(tick_ms=10, slots=10, start_ms=0)
    w.add(np.array([5, 25], dtype=np.int64), np.array([1, 2], dtype=np.uint64))
    assert w.pop_due(20)[0].tolist() == [5]
    state = (w.time_ms, w.cursor_ms, w.horizon_ms, len(w))
    d, r = w.pop_due(3)
    assert d.dtype == np.int64 and r.dtype == np.uint64 and len(d) == len(r) == 0
    assert (w.time_ms, w.cursor_ms, w.horizon_ms, len(w)) == state


def test_delay_longer_than_a_rotation_is_beyond_never_early():
    """tick 1, 3 slots: due 5 ms out is BEYOND, not slot 5 % 3; once in range it fires on time."""
    w = TimeWheel(tick_ms=1, slots=3, start_ms=0)
    assert w.add(np.array([5], dtype=np.int64), np.array([9], dtype=np.uint64)).tolist() == [BEYOND]
    assert w.add(np.array([2, 3], dtype=np.int64), np.array([1, 2], dtype=np.uint64)).tolist() == [
        ADDED,
        BEYOND,
    ]
    assert w.pop_due(1)[0].tolist() == []
    assert (w.cursor_ms, w.horizon_ms) == (2, 5)
    assert w.add(np.array([5, 4], dtype=np.int64), np.array([9, 8], dtype=np.uint64)).tolist() == [
        BEYOND,
        ADDED,
    ]
    assert w.pop_due(3)[0].tolist() == [2]
    assert w.pop_due(4)[0].tolist() == [4]


def test_expired_means_at_or_before_the_last_now():
    """After pop_due(now), an entry due at now is EXPIRED: it would already have been released."""
    w = TimeWheel(tick_ms=500, slots=4, start_ms=1_000)
    due = np.array([999, 1_000], dtype=np.int64)
    assert w.add(due, np.array([1, 2], dtype=np.uint64)).tolist() == [EXPIRED, ADDED]
    w.pop_due(1_200)
    assert w.add(np.array([1_200, 1_201]), np.array([3, 4])).tolist() == [EXPIRED, ADDED]


def test_next_due_ms_looks_past_an_empty_cursor_slot():
    """An empty head falls back to the later tiers' minimum, updated by adds and removes."""
    w = TinyWheel(tick_ms=10, slots=100, start_ms=0)
    w.add(np.array([505, 300, 301, 299], dtype=np.int64), np.arange(4, dtype=np.uint64))
    assert w.next_due_ms() == 299
    w.add(np.array([250], dtype=np.int64), np.array([7], dtype=np.uint64))
    assert w.next_due_ms() == 250
    assert w.remove(np.array([7, 3], dtype=np.uint64)) == 2
    assert w.next_due_ms() == 300
    assert w.pop_due(299)[0].tolist() == []
    assert w.next_due_ms() == 300
    assert w.check() == []


def test_remove_counts_every_matching_entry():
    """Duplicated refs are all removed and counted; unknown refs are ignored."""
    w = TinyWheel(tick_ms=5, slots=50, start_ms=0)
    due = np.array([1, 2, 30, 60, 60, 200], dtype=np.int64)
    refs = np.array([5, 6, 5, 7, 5, 2**64 - 1], dtype=np.uint64)
    w.add(due, refs)
    assert w.remove(np.array([5, 2**64 - 1, 99], dtype=np.uint64)) == 4
    assert w.remove(np.array([], dtype=np.uint64)) == 0
    d, r = w.pop_due(1_000)
    assert d.tolist() == [2, 60] and r.tolist() == [6, 7]


def test_empty_arrays():
    """Empty adds, pops and removes are fine and keep the dtypes."""
    w = TimeWheel()
    status = w.add(np.array([], dtype=np.int64), np.array([], dtype=np.uint64))
    assert status.dtype == np.uint8 and status.shape == (0,)
    d, r = w.pop_due(10)
    assert d.dtype == np.int64 and r.dtype == np.uint64 and d.shape == r.shape == (0,)
    assert w.remove(np.array([], dtype=np.uint64)) == 0
    assert len(w) == 0 and w.nbytes == 0 and w.next_due_ms() is None


def test_accepts_other_integer_dtypes():
    """int32 due times and signed refs are converted; the wheel keeps int64 and uint64."""
    w = TimeWheel(tick_ms=10, slots=10)
    w.add(np.array([3, 1], dtype=np.int32), np.array([7, 8], dtype=np.int16))
    d, r = w.pop_due(5)
    assert d.dtype == np.int64 and r.dtype == np.uint64
    assert d.tolist() == [1, 3] and r.tolist() == [8, 7]


@pytest.mark.parametrize(
    ("due", "refs", "error", "match"),
    [
        pytest.param(np.array([1.5]), np.array([1]), TypeError, "due_ms", id="float-due"),
        pytest.param(np.array([1]), np.array([1.0]), TypeError, "refs", id="float-refs"),
        pytest.param(np.array([True]), np.array([1]), TypeError, "due_ms", id="bool-due"),
        pytest.param(np.array(["1"]), np.array([1]), TypeError, "due_ms", id="str-due"),
        pytest.param(np.zeros((2, 2), np.int64), np.zeros(4, np.uint64), ValueError, "one-dim",
                     id="2d-due"),
        pytest.param(np.int64(5), np.uint64(1), ValueError, "one-dim", id="scalar"),
        pytest.param(np.arange(3), np.arange(2, dtype=np.uint64), ValueError, "differ in length",
                     id="length-mismatch"),
        pytest.param(np.array([1]), np.array([-1]), ValueError, "negative", id="negative-ref"),
        pytest.param(np.array([2**63], np.uint64), np.array([1]), ValueError, "int64",
                     id="due-overflow"),
    ],
)
def test_add_rejects_bad_arrays(due, refs, error, match):
    """Wrong dtype is a TypeError, wrong shape or values a ValueError, each saying which."""
    w = TimeWheel()
    with pytest.raises(error, match=match):
        w.add(due, refs)
    assert len(w) == 0


def test_other_arguments_are_validated():
    """Constructor, pop_due and remove say what they expected."""
    with pytest.raises(ValueError, match="tick_ms"):
        TimeWheel(tick_ms=0)
    with pytest.raises(ValueError, match="slots"):
        TimeWheel(slots=0)
    with pytest.raises(TypeError, match="tick_ms"):
        TimeWheel(tick_ms=0.5)  # type: ignore[arg-type]  # the wrong type on purpose
    with pytest.raises(ValueError, match="tick_ms \\* slots"):
        TimeWheel(tick_ms=2**40, slots=2**40)
    w = TimeWheel()
    with pytest.raises(TypeError, match="now_ms"):
        w.pop_due(1.5)  # type: ignore[arg-type]  # the wrong type on purpose
    with pytest.raises(TypeError, match="now_ms"):
        w.pop_due(True)
    with pytest.raises(ValueError, match="now_ms"):
        w.pop_due(2**63)
    with pytest.raises(TypeError, match="refs"):
        w.remove(np.array([1.0]))
    with pytest.raises(ValueError, match="one-dim"):
        w.remove(np.zeros((1, 1), np.uint64))
    assert w.pop_due(np.int64(7))[0].tolist() == []  # type: ignore[arg-type]  # numpy integers are fine
    assert w.time_ms == 8


def test_geometry_properties_and_start_validation():
    """The geometry reads back; a start time out of range is refused."""
    w = TimeWheel(tick_ms=7, slots=5, start_ms=-3)
    assert (w.tick_ms, w.slots, w.time_ms, w.cursor_ms, w.horizon_ms) == (7, 5, -3, -7, 28)
    assert "tick_ms=7" in repr(w)
    with pytest.raises(ValueError, match="start_ms"):
        TimeWheel(start_ms=2**63)


def test_check_reports_a_broken_wheel():
    """The audit is not vacuous: it sees a head out of order and a wrong count."""
    w = TimeWheel(tick_ms=100, slots=10)
    w.add(np.array([10, 20, 500], dtype=np.int64), np.arange(3, dtype=np.uint64))
    assert w.check() == []
    w._head_due = w._head_due[::-1].copy()
    w._count += 1
    problems = w.check()
    assert any("not sorted" in p for p in problems)
    assert any("entries are held" in p for p in problems)


def test_wheel_owns_its_arrays():
    """Mutating what was passed in or handed out does not reach the wheel."""
    w = TimeWheel(tick_ms=10, slots=10)
    due = np.array([1, 2, 15], dtype=np.int64)
    refs = np.array([1, 2, 3], dtype=np.uint64)
    w.add(due, refs)
    due[:] = 0
    refs[:] = 0
    d, r = w.pop_due(1)
    d[:] = 99
    assert w.pop_due(20)[0].tolist() == [2, 15]


def test_memory_per_entry_after_bulk_add_of_1m():
    """16 bytes per entry after loading a segment's million; at most 20 while it drains."""
    rng = np.random.default_rng(7)
    n = 1_000_000
    w = TimeWheel(tick_ms=500, slots=16384, start_ms=0)
    due = rng.integers(0, 3_600_000, n)
    status = w.add(due, np.arange(n, dtype=np.uint64))
    assert not status.any() and len(w) == n
    assert w.nbytes / len(w) <= 16
    assert w.check() == []
    released = 0
    for now in range(0, 3_600_000, 97_003):
        released += len(w.pop_due(now)[0])
        assert w.nbytes <= 20 * len(w)
    assert released + len(w) == n
    assert w.check() == []


def test_catch_up_jump_over_a_loaded_hour():
    """One pop_due across a whole loaded hour releases it all in due order, ties by insertion."""
    rng = np.random.default_rng(11)
    n = 300_000
    w = TimeWheel(tick_ms=500, slots=16384, start_ms=0)
    due = rng.integers(0, 3_600_000, n)
    refs = np.arange(n, dtype=np.uint64)
    w.add(due[: n // 2], refs[: n // 2])
    for i in range(n // 2, n, 100):  # late arrivals in small batches: staging, runs, merges
        w.add(due[i : i + 100], refs[i : i + 100])
    assert w.check() == []
    order = np.argsort(due, kind="stable")
    d, r = w.pop_due(3_599_999)
    assert np.array_equal(d, due[order]) and np.array_equal(r, refs[order])
    assert len(w) == 0


def test_already_bucketed_input_is_not_sorted_again():
    """A load that arrives sorted by due (a sealed part) is chunked as is, and released right."""
    w = TinyWheel(tick_ms=10, slots=1000)
    due = np.repeat(np.arange(20, 200, 3, dtype=np.int64), 2)
    refs = np.arange(len(due), dtype=np.uint64)
    w.add(due, refs)
    assert w.check() == []
    d, r = w.pop_due(10_000)
    assert np.array_equal(d, due) and np.array_equal(r, refs)


@settings(max_examples=200, deadline=None)
@given(
    bits=st.sampled_from([4, 16, 17, 32, 33, 40]),
    raw=hnp.arrays(np.int64, st.integers(0, 300), elements=st.integers(0, 2**40 - 1)),
)
def test_stable_argsort_matches_numpy(bits, raw):
    """The radix passes (one, two) and the fallback all give numpy's stable order."""
    span = 1 << bits
    keys = raw % span
    want = np.argsort(keys, kind="stable")
    for radix_min in (0, 256):
        assert np.array_equal(_stable_argsort(keys, span, radix_min), want)
