"""The dispatch queue's set of refs against a plain Python set, under any mix of operations."""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from timewheel._ref_set import RefSet

_refs = st.lists(st.integers(0, 2**64 - 1) | st.integers(0, 40), max_size=60)
_ops = st.lists(st.tuples(st.sampled_from(["add", "discard", "forget_odd", "forget_above"]), _refs), max_size=40)


def _arr(xs: list[int]) -> np.ndarray:
    return np.array(xs, np.uint64)


@settings(max_examples=300, deadline=None)
@given(_ops, _refs)
def test_a_ref_set_answers_as_a_python_set(ops: list[tuple[str, list[int]]], probe: list[int]) -> None:
    s, model = RefSet(), set()
    for op, xs in ops:
        if op == "add":
            s.add(_arr(xs))
            model |= set(xs)
        elif op == "discard":
            s.discard(_arr(xs))
            model -= set(xs)
        elif op == "forget_odd":
            assert s.forget(lambda r: (r & np.uint64(1)) == 1) == sum(1 for x in model if x & 1)
            model = {x for x in model if not x & 1}
        else:
            bound = xs[0] if xs else 20
            assert s.forget(lambda r: r > np.uint64(bound)) == sum(1 for x in model if x > bound)
            model = {x for x in model if x <= bound}
        assert len(s) == len(model) and bool(s) == bool(model)
    everything = list(model) + probe
    assert s.contains(_arr(everything)).tolist() == [x in model for x in everything]


def test_levels_stay_logarithmic_under_many_small_adds() -> None:
    s = RefSet()
    for k in range(2000):
        s.add(np.arange(k * 50, k * 50 + 50, dtype=np.uint64))
    assert len(s) == 100_000
    assert len(s._levels) <= 17  # log2 of 100,000 / 50, and one
    assert s.contains(np.array([0, 99_999, 100_000], np.uint64)).tolist() == [True, True, False]
