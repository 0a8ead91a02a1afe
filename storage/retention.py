"""Retention: segments whose every record is done leave the data directory (or go to archive/)."""
from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING

from storage.audit import summarize_segment

if TYPE_CHECKING:
    from storage.store import ScheduleStore


def retire(store: "ScheduleStore", now_ms: int, min_age_ms: int, *, archive: bool = False) -> list[int]:
    """Remove (or move to archive/) segments that ended at least `min_age_ms` ago and whose every
    record was dispatched, dead-lettered, cancelled or found corrupt; never others."""
    layout = store.layout
    retired = []
    for seg in layout.list_segments():
        if seg + layout.segment_ms + min_age_ms > now_ms:
            break
        if store.is_live(seg):
            continue
        if summarize_segment(layout, seg).pending:
            continue
        store.release_segment(seg)
        store.dispatch_writer.forget(seg)
        src = layout.segment_dir(seg)
        if archive:
            layout.archive_dir.mkdir(parents=True, exist_ok=True)
            os.replace(src, layout.archive_dir / src.name)
        else:
            shutil.rmtree(src)
        store.meta.forget_segment(seg)
        retired.append(seg)
    return retired
