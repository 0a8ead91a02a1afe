"""A set of wheel refs kept as sorted numpy arrays: the dispatch queue's cancelled and withdrawn refs.

Every `take()` asks which refs of its batch are in the set, and a cancel adds to it while the
set may hold hundreds of thousands (a workload that cancels most of what it schedules, as orders
that are paid before their timeout). `np.isin` and `np.union1d` sort the whole set on each call:
with 100,000 refs held, a take and a cancel each cost about 11 ms, so the dispatcher fell to a
hundred sends a second. Here the set is a few sorted levels, merged as in a binary counter (a
level is merged into the next once that one is no more than twice its size), so an add costs
O(log n) a ref amortised and a test is a binary search per ref and level.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

def _member(refs: np.ndarray, level: np.ndarray) -> np.ndarray:
    """Which of `refs` are in the sorted, non-empty `level`."""
    at = np.searchsorted(level, refs)
    np.minimum(at, len(level) - 1, out=at)
    return level[at] == refs


class RefSet:
    """Wheel refs (uint64) with batch membership tests; not thread-safe (its owner locks)."""

    __slots__ = ("_levels",)

    def __init__(self) -> None:
        self._levels: list[np.ndarray] = []  # sorted, unique, disjoint; larger ones first

    def __len__(self) -> int:
        return sum(len(level) for level in self._levels)

    def __bool__(self) -> bool:
        return bool(self._levels)

    def add(self, refs: np.ndarray) -> None:
        """Add refs (any order, repeats and refs already held allowed)."""
        new = np.unique(np.asarray(refs, np.uint64))
        if self._levels and len(new):
            new = new[~self.contains(new)]
        if not len(new):
            return
        while self._levels and len(self._levels[-1]) <= 2 * len(new):
            new = np.union1d(self._levels.pop(), new)
        self._levels.append(new)

    def contains(self, refs: np.ndarray) -> np.ndarray:
        """A mask: which of `refs` are held."""
        hit = np.zeros(len(refs), bool)
        if len(refs):
            for level in self._levels:
                hit |= _member(refs, level)
        return hit

    def discard(self, refs: np.ndarray) -> None:
        """Remove these refs (those not held are ignored)."""
        gone = np.unique(np.asarray(refs, np.uint64))
        if len(gone):
            self._keep(lambda level: ~_member(level, gone))

    def forget(self, where: Callable[[np.ndarray], np.ndarray]) -> int:
        """Remove every held ref for which `where(refs)` (a mask) is True; returns how many went."""
        before = len(self)
        self._keep(lambda level: ~where(level))
        return before - len(self)

    def _keep(self, keep: Callable[[np.ndarray], np.ndarray]) -> None:
        levels = []
        for level in self._levels:
            mask = keep(level)
            level = level if mask.all() else level[mask]
            if len(level):
                levels.append(level)
        levels.sort(key=len, reverse=True)
        self._levels = levels
