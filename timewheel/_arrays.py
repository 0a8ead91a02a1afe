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
    if same(values):
        return [(int(values[0]), slice(None))]
    return [(v, values == v) for v in np.unique(values).tolist()]


def same(values: np.ndarray) -> bool:
    """Whether every element of a non-empty 1-d array equals the first (a few: no array work)."""
    if len(values) <= FEW:
        few = values.tolist()
        return few.count(few[0]) == len(few)
    return bool((values == values[0]).all())


def all_true(mask: np.ndarray) -> bool:
    """Whether every element of a 1-d boolean array is True (a few: no array work)."""
    return all(mask.tolist()) if len(mask) <= FEW else bool(mask.all())


def smallest(values: np.ndarray) -> int:
    """The least element of a non-empty 1-d integer array (a few: no array work)."""
    return min(values.tolist()) if len(values) <= FEW else int(values.min())


def counts(values: np.ndarray) -> list[tuple[int, int]]:
    """(value, how many times it occurs) for each distinct value, in value order."""
    if len(values) <= FEW:
        out: dict[int, int] = {}
        for v in sorted(values.tolist()):
            out[v] = out.get(v, 0) + 1
        return list(out.items())
    distinct, n = np.unique(values, return_counts=True)
    return list(zip(distinct.tolist(), n.tolist()))


def error_notes(errors: list[str | None] | None, n: int) -> list[str]:
    """Per failed row, what to record of why it failed."""
    if errors is None:
        return ["the sink did not say why"] * n
    return [e or "the sink did not say why" for e in errors]


def by_note(notes: list[str]) -> list[tuple[str, np.ndarray]]:
    """Rows grouped by their note (a failed send batch has one error per request, so few groups)."""
    rows: dict[str, list[int]] = {}
    for i, note in enumerate(notes):
        rows.setdefault(note, []).append(i)
    return [(note, np.asarray(idx, np.int64)) for note, idx in rows.items()]


def rows_by_topic(topics: list[str]) -> dict[str, list[int]]:
    """Each topic's rows, from every row's topic."""
    rows: dict[str, list[int]] = {}
    for i, topic in enumerate(topics):
        rows.setdefault(topic, []).append(i)
    return rows
