"""Cancels a standby reads after their message came due: each recorded CANCELLED at once, exactly once.

A standby sends nothing while another replica holds the lease, so a cancel it reads after its
message came due still finds that message unsent: it is withdrawn (`TimerDriver.withdraw`). The
outcome goes to the dispatch log before the cancel is acknowledged, wherever the entry is: a
CANCELLED kept only in memory would be lost by a crash, and the restarted replica would load the
message as due and send it once it holds the lease. Exactly one terminal outcome per entry, and one
count off its segment, come from who holds the entry when the cancel arrives:
- a segment not loaded: nothing of it is in memory; its load reads this row (`record_cancelled`);
- an entry the timer still holds (in the wheel, not released yet, or deferred behind the catch-up):
  cancelled as one not yet due is (`held_by_timer`), under the timer's lock;
- an entry waiting in the dispatch queue: recorded under the queue's lock, so that no `take()` gets
  between, and then dropped unrecorded (`waiting_among`, `record_claimed`);
- an entry a dispatch pass has in hand: a pass with a gate takes without claiming (`DispatchQueue.take`,
  `claim=False`), puts back what it may not send (the gate's hold) and only then `claim()`s the rest,
  under the queue's lock: before that claim the entry is recorded like one waiting (and the claim
  leaves it out), after it the pass may be sending it, and a replica that got `may_send()` True in
  the meantime is a holder, which skips a cancel read late;
- an entry the traffic shaper holds (read while this replica held the lease, kept after it ran out):
  taken out of the held queues and queued again under the dispatcher's lock
  (`Dispatcher.release_held`, called by the timer first), then recorded as one waiting;
- any other (a pass claimed it and it is on its way to the sink, or its outcome is recorded already):
  the pass that sends it, if it comes back unsent (a fence held it on its way: the lease ran out
  while the pass was sending; or its send failed and it waits for a retry), records it as soon as it
  is back in the queue (`record_put_back`); else the `take()` that meets it again, if one does, drops
  it for its thread to record (`DispatchQueue.drain_withdrawn`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import numpy as np

from storage import CANCELLED, TERMINAL, ScheduleStore, dispatch_entries, record_keys
from timewheel._due import DueChunks, DueEntries
from timewheel._ref_set import RefSet

if TYPE_CHECKING:
    from timewheel.dispatch_queue import DispatchQueue


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


def held_by_timer(refs: np.ndarray, due: np.ndarray, wheel_time_ms: int, deferred: DueChunks) -> np.ndarray:
    """A mask: which entries of a loaded segment the timer still holds, none of them released to the
    dispatch queue yet: due at or after the wheel's first millisecond not released, or deferred."""
    mine = due >= wheel_time_ms
    if deferred.size and not mine.all():
        mine |= np.isin(refs, waiting_among(refs[~mine], deferred.chunks).refs)
    return mine


def waiting_among(refs: np.ndarray, waiting: Iterable[DueEntries]) -> DueEntries:
    """The entries of `waiting` (chunks of due entries) whose refs are among `refs`, each once."""
    wanted = RefSet()
    wanted.add(refs)
    found = [hit for e in waiting if len(e.due) and len((hit := e.select(wanted.contains(e.refs))).due)]
    if not found:
        return DueEntries.empty()
    got = DueEntries.concat(found)
    _, first = np.unique(got.refs, return_index=True)
    return got if len(first) == len(got.due) else got.select(np.sort(first))


def record_claimed(store: ScheduleStore, now_ms: int, entries: DueEntries) -> None:
    """Record CANCELLED for entries withdrawn while waiting in the dispatch queue (one frame a segment)."""
    for seg in np.unique(entries.segs).tolist():
        m = entries.segs == seg
        store.record_dispatch(seg, dispatch_entries(entries.parts[m], entries.offsets[m], entries.due[m], now_ms,
                                                    CANCELLED, entries.attempts[m]), now_ms)


def record_put_back(queue: DispatchQueue, store: ScheduleStore, now_ms: int, refs: np.ndarray) -> None:
    """Record CANCELLED now for the entries of `refs` (a pass's batch, back in the queue unsent) that a
    late cancel withdrew while the pass was sending them, and count them off their segments.

    Left to the next `take()`, a fenced batch's withdrawn entries waited a hold, and a failed one's a
    backoff, cancelled only in memory: a crash in between lost the acknowledged cancel, and the
    restarted replica sent the message once it held the lease.
    """
    got: list[DueEntries] = []

    def record(here: DueEntries) -> None:
        record_claimed(store, now_ms, here)
        got.append(here)

    queue.withdraw(refs, record, again=True)
    for e in got:  # outside the queue's lock, which `count_done` takes
        segs, counts = np.unique(e.segs, return_counts=True)
        for seg, n in zip(segs.tolist(), counts.tolist()):
            queue.count_done(seg, n)
