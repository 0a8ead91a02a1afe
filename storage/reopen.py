"""Done segments that a published part makes pending again.

A segment is marked done (`MetaStore.mark_segment_done`) with the parts the engine read it from. A
sealed part published into it afterwards (a backfill that ends after the hour it wrote into, or
runs while the engine is stopped) holds records no one has sent, and a done segment is never loaded
again: so a done segment holding a part its mark does not name is pending again, and its mark goes
before the caller loads it (the loader skips what its dispatch log says was sent). Parts are only
ever added to a segment (retention takes it whole), so a part number is never reused within it.

A mark written by an older build names no parts. Such a segment is judged by its files' times
instead: a part linked in (a change of its inode, ctime) no earlier than the dispatch log's last
write came after the last outcome, and may hold records never sent (reloading a segment found so
for another reason costs one load, never a message). One judged whole gets a mark naming its
parts, so that only the exact test applies from then on.
"""
from __future__ import annotations

import os
from typing import Iterable

from storage.layout import PART_INDEX_SUFFIX, PART_LOG_SUFFIX, SegmentLayout
from storage.meta import MetaStore


def reopen_segments(layout: SegmentLayout, meta: MetaStore, segments: Iterable[int]) -> list[int]:
    """Of these segments, clear the done mark of each that holds a part its mark does not name, and
    return them, oldest first; segments not marked done, or gone (retired), are passed over."""
    segs = sorted(segments)
    reopened = []
    for seg, marked in meta.done_parts(segs).items():
        parts = _parts(layout, seg)
        if not parts:
            continue  # no directory (retired, or an hour with nothing stored): nothing to send
        if marked is not None:
            if set(parts).issubset(marked):
                continue
        elif not _linked_after_last_outcome(layout, seg, parts):
            meta.mark_segment_done(seg, parts)  # an older build's mark, found whole: name its parts
            continue
        meta.forget_segment(seg)
        reopened.append(seg)
    return reopened


def _parts(layout: SegmentLayout, segment_ms: int) -> list[int]:
    """A segment's part numbers (those `SegmentLayout.list_parts` gives, in one listing: a running
    timer looks into many done segments); none when its directory is gone (retired meanwhile)."""
    try:
        names = set(os.listdir(layout.segment_dir(segment_ms)))
    except FileNotFoundError:
        return []
    # with its index only, as the loader reads them: a record file without one (a crash between the
    # two names) holds nothing the loader would read, and would reopen the segment at every rescan
    return sorted(int(n[:5]) for n in names if len(n) == 9 and n.endswith(PART_LOG_SUFFIX) and n[:5].isdigit()
                  and n[:5] + PART_INDEX_SUFFIX in names)


def _linked_after_last_outcome(layout: SegmentLayout, segment_ms: int, parts: list[int]) -> bool:
    """Whether a part's record file changed no earlier than the segment's dispatch log last did."""
    try:
        last = os.stat(layout.dispatch_log(segment_ms)).st_mtime_ns
    except FileNotFoundError:
        last = -1  # no outcome at all: any part may hold records never sent
    for part in parts:
        try:
            if os.stat(layout.part_log(segment_ms, part)).st_ctime_ns >= last:
                return True
        except FileNotFoundError:
            continue  # retired meanwhile
    return False
