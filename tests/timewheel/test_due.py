"""Retry arrays kept in chunks answer exactly as one array would, under any mix of adds and pops."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from timewheel._due import DueEntries, RetryArrays


class _OneArray:
    """The plain reading: every waiting entry in one array, in add order."""

    def __init__(self) -> None:
        self.next_ms = np.empty(0, np.int64)
        self.entries = DueEntries.empty()

    def add(self, next_ms: np.ndarray, entries: DueEntries) -> None:
        self.next_ms = np.concatenate((self.next_ms, next_ms))
        self.entries = DueEntries.concat([self.entries, entries]) if len(self.entries.due) else entries

    def pop_ready(self, now: int) -> DueEntries | None:
        sel = self.next_ms <= now
        if not sel.any():
            return None
        out = self.entries.select(sel)
        self.next_ms, self.entries = self.next_ms[~sel], self.entries.select(~sel)
        return out.select(np.argsort(out.due, kind="stable"))


def _entries(due: list[int], first_ref: int) -> DueEntries:
    n = len(due)
    refs = np.arange(first_ref, first_ref + n, dtype=np.uint64)
    return DueEntries(np.array(due, np.int64), refs, np.ones(n, np.int16), np.zeros(n, np.int64),
                      np.zeros(n, np.uint16), refs.astype(np.uint32))


def _same(a: DueEntries | None, b: DueEntries | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return all(np.array_equal(x, y) for x, y in zip(a, b))


_add = st.tuples(st.just("add"), st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), max_size=8))
_pop = st.tuples(st.just("pop"), st.integers(0, 60))


@pytest.mark.parametrize("max_chunks", [3, RetryArrays._MAX_CHUNKS])
@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(_add, _pop), max_size=150))
def test_retry_arrays_answer_as_one_array(max_chunks: int, ops: list[tuple]) -> None:
    chunks, one = RetryArrays(), _OneArray()
    chunks._MAX_CHUNKS = max_chunks  # merges often, or as the product does
    ref = 0
    for op, arg in ops:
        if op == "add":
            due = [d for d, _ in arg]
            nxt = np.array([n for _, n in arg], np.int64)
            chunks.add(nxt, _entries(due, ref))
            one.add(nxt, _entries(due, ref))
            ref += len(arg)
        else:
            assert _same(chunks.pop_ready(arg), one.pop_ready(arg))
        assert len(chunks) == len(one.next_ms)
        assert chunks.next_ms_min() == (int(one.next_ms.min()) if len(one.next_ms) else None)
        assert chunks.due_min() == (int(one.entries.due.min()) if len(one.next_ms) else None)
    assert np.array_equal(chunks.next_ms, one.next_ms) and _same(chunks.entries, one.entries)
