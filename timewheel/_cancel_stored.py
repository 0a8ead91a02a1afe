"""Cancelling stored messages: the records a cancel names, recorded CANCELLED segment by segment.

Each segment is whole before the next is begun: its CANCELLED frame written, its entries kept from
being sent (`TimerDriver.cancel`; on a standby, those already due too: `TimerDriver.withdraw`), its
ids marked cancelled in the meta store. A write that fails on a later segment (a full disk) so
leaves the earlier ones done and known to be done: the cancel, applied again (its batch pulled
again, the admin call repeated), finds only what is left, and no record gets a second outcome nor is
counted off its segment twice. One window is left: a crash, or a meta-store write refused, between
a segment's frame and its ids' marks. The retry then writes the frame again (a load reads a repeated
outcome once), and until the next start that segment's count of entries left is low by those
records.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from storage import CorruptRecordError, ScheduleStore
from timewheel.clock import Clock
from timewheel.cancels import producer_id
from timewheel.timer import TimerDriver


def cancel_stored(store: ScheduleStore, timer: TimerDriver, clock: Clock,
                  named: Sequence[tuple[str | None, str | None]], standby: Callable[[], bool],
                  count: Callable[[int], None]) -> int:
    """Cancel what each (msg_id, key) names; `count(n)` as each part is done; how many in all.

    `standby()`: whether this replica sends nothing now (the gate holds its due entries).
    """
    meta = store.meta
    found: list[str] = []
    for msg_id, key in named:
        if msg_id is not None:
            # an id as a RocketMQ producer knows it (UNIQ_KEY) names the engine ids made from it
            found += [msg_id] if meta.known([msg_id])[0] else [
                i for i in meta.ids_with_prefix(msg_id + ":") if producer_id(i) == msg_id]  # not "A:B:…" for "A"
        else:
            assert key is not None
            found += meta.ids_for_key(key)
    ids = [i for i in dict.fromkeys(found) if not meta.is_cancelled(i)]
    if not ids:
        return 0
    now = clock.now_ms()
    # A standby has sent none of its due entries (the gate held them): one cancelled late is
    # withdrawn rather than kept, or it would go out once this replica holds the lease.
    held = standby()
    by_seg: dict[int, tuple[list[tuple[int, int, int]], list[str]]] = {}
    late: dict[int, tuple[list[tuple[int, int, int]], list[str]]] = {}
    for mid, loc in zip(ids, meta.locations(ids)):
        if loc is None:
            continue
        try:
            rec = store.read_record(loc.segment_ms, loc.part, loc.offset)
        except CorruptRecordError:
            continue
        if rec.due_ms <= now:
            if held:
                rows, mids = late.setdefault(loc.segment_ms, ([], []))
                rows.append((loc.part, loc.offset, rec.due_ms))
                mids.append(mid)
            continue  # already due: it is being, or has been, delivered
        rows, mids = by_seg.setdefault(loc.segment_ms, ([], []))
        rows.append((loc.part, loc.offset, rec.due_ms))
        mids.append(mid)
    total = 0
    for seg, (rows, mids) in by_seg.items():
        timer.cancel({seg: np.array(rows, dtype=np.int64)}, now)
        meta.mark_cancelled(mids, now)
        count(len(mids))
        total += len(mids)
    for seg, (rows, mids) in late.items():
        timer.withdraw({seg: np.array(rows, dtype=np.int64)}, now)
        meta.mark_cancelled(mids, now)
        count(len(mids))
        total += len(mids)
    return total
