"""The dispatch path's small-array helpers agree with numpy's own grouping."""
from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from timewheel._arrays import all_true, counts, groups, same, smallest

small_ints = st.lists(st.integers(-3, 3), max_size=40).map(lambda xs: np.asarray(xs, np.int64))


@given(small_ints)
def test_groups_select_each_distinct_value_s_positions(values: np.ndarray) -> None:
    got = groups(values)
    assert [v for v, _ in got] == np.unique(values).tolist()
    for v, sel in got:
        assert (values[sel] == v).all() and len(values[sel]) == int((values == v).sum())


@given(small_ints)
def test_counts_match_numpy(values: np.ndarray) -> None:
    distinct, n = np.unique(values, return_counts=True)
    assert counts(values) == list(zip(distinct.tolist(), n.tolist()))


@given(small_ints.filter(len))
def test_same_and_smallest_match_numpy_at_every_length(values: np.ndarray) -> None:
    """Up to FEW elements they read a Python list, past it the array: both answer as numpy does."""
    assert same(values) is bool((values == values[0]).all())
    assert smallest(values) == int(values.min())


@given(st.lists(st.booleans(), min_size=1, max_size=40).map(lambda xs: np.asarray(xs, bool)))
def test_all_true_matches_numpy(mask: np.ndarray) -> None:
    assert all_true(mask) is bool(mask.all())
