"""Small numpy helpers for the dispatch path, where batches are often a few messages long."""
from __future__ import annotations

import numpy as np

# At or below this many elements a Python loop beats a sort (np.unique costs ~10 µs to set up).
FEW = 16


def groups(values: np.ndarray) -> list[tuple[int, np.ndarray | slice]]:
    """Each distinct value of a 1-d integer array with a selector of its positions, in value order.

    A batch usually comes from one segment: that case is one comparison, not a sort.
    """
    if not len(values):
        return []
    first = int(values[0])
    if (values == first).all():
        return [(first, slice(None))]
    return [(v, values == v) for v in np.unique(values).tolist()]


def counts(values: np.ndarray) -> list[tuple[int, int]]:
    """(value, how many times it occurs) for each distinct value, in value order."""
    if len(values) <= FEW:
        out: dict[int, int] = {}
        for v in sorted(values.tolist()):
            out[v] = out.get(v, 0) + 1
        return list(out.items())
    distinct, n = np.unique(values, return_counts=True)
    return list(zip(distinct.tolist(), n.tolist()))
