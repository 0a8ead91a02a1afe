"""Past segments the timer catches up besides those a start finds not done: those a pause let pass
unseen, and done ones that a part published since makes pending again (`TimerDriver`, under its lock)."""
from __future__ import annotations

from collections import deque
from typing import Container

from storage import ScheduleStore, reopen_segments

# Done segments whose directories a rescan lists, at most (newest first, then on at the next): with
# retention off they add up to one an hour, and the pass holds the timer's lock (20 to 70 µs each)
DONE_CHECKS = 16


def unseen(store: ScheduleStore, loaded: Container[int], since: int, current: int) -> list[int]:
    """The segments from `since` to `current` neither loaded nor done: no pass saw them as current or
    next (the timer did not run while they passed), so they are loaded as a start loads them."""
    done = store.meta.done_now()
    return [s for s in store.layout.list_segments(since, current) if s not in loaded and s not in done]


def reopened(store: ScheduleStore, to_check: deque[int], loaded: Container[int], current: int) -> list[int]:
    """Past segments marked done, of the next slice of `to_check` (refilled with every done segment,
    newest first, once empty), that a part published since makes pending again."""
    if not to_check:
        to_check.extend(sorted(store.meta.done_now(), reverse=True))
    batch = [to_check.popleft() for _ in range(min(DONE_CHECKS, len(to_check)))]
    return reopen_segments(store.layout, store.meta, [s for s in batch if s < current and s not in loaded])
