"""Cancels a standby reads after their message came due, for a segment not loaded yet."""
from __future__ import annotations

import numpy as np

from storage import CANCELLED, TERMINAL, ScheduleStore, dispatch_entries, record_keys


def record_cancelled(store: ScheduleStore, segment_ms: int, rows: np.ndarray, now_ms: int) -> int:
    """Record CANCELLED for `rows` (part, offset, due) of a segment nothing of which is in memory (a past
    one waiting for the catch-up), skipping those with an outcome already; how many were recorded.

    The dispatch queue holds nothing of such a segment to withdraw, and its load reads the dispatch log
    and leaves out what has an outcome: without this row the catch-up would load the message like any
    other, and the replica would send it once it holds the lease.
    """
    done = store.dispatch_log(segment_ms).entries
    done = done[np.isin(done["outcome"], TERMINAL)]
    todo = rows[~np.isin(record_keys(rows[:, 0], rows[:, 1]), record_keys(done["part"], done["offset"]))]
    if len(todo):
        store.record_dispatch(segment_ms, dispatch_entries(todo[:, 0], todo[:, 1], todo[:, 2], now_ms, CANCELLED, 0),
                              now_ms)
    return len(todo)
