"""What retention holds of a segment while it moves it out: the forgotten records' index rows in
the index's own widths and only the cancel marks there were, and all of it given back whole when
the move is refused (a segment of 36 million records, an hour at 10k/s, once held 1.2 GB more)."""
from __future__ import annotations

from pathlib import Path

from storage import DELIVERED, Record, ScheduleStore, dispatch_entries
from storage.retention import forget_segment_records, put_back_segment_records

NOW = 1_800_000_000_000
HOUR = 3_600_000


def test_a_forgotten_segment_is_held_in_ten_bytes_a_record_and_given_back_whole(tmp_path: Path) -> None:
    s = ScheduleStore(tmp_path / "d")
    try:
        n = 20_000
        s.append([Record(f"m{i}", "T", b"x", NOW + i, keys=(f"k{i % 7}",)) for i in range(n)], NOW)
        cancelled = [f"m{i}" for i in range(0, n, 997)]
        for k, mid in enumerate(cancelled):
            s.meta.mark_cancelled([mid], NOW + k)
        seg = s.layout.segment_start(NOW)
        s.seal_live_parts(NOW + 10 * HOUR)
        ix = s.segment_index(seg)
        s.record_dispatch(seg, dispatch_entries(ix.part, ix.offset, ix.due_ms, NOW, DELIVERED), NOW)
        s.checkpoint()
        ids = [f"m{i}" for i in range(n)]
        locations = s.meta.locations(ids)
        marks = [s.meta.cancelled_at(m) for m in cancelled]
        by_key = sorted(s.meta.ids_for_key("k3", n))

        forgotten = forget_segment_records(s, seg)
        assert len(forgotten) == n and s.meta.locations(ids[:3]) == [None] * 3
        held = sum(a.nbytes for a in (forgotten.part, forgotten.offset, forgotten.length, forgotten.cancelled,
                                      forgotten.cancel_at))
        assert held <= 10 * n + 16 * len(cancelled), f"{held / n:.1f} bytes a record"

        assert put_back_segment_records(s, seg, forgotten) == n
        assert s.meta.locations(ids) == locations
        assert [s.meta.cancelled_at(m) for m in cancelled] == marks == [NOW + k for k in range(len(cancelled))]
        assert s.meta.cancelled_at("m1") is None
        assert sorted(s.meta.ids_for_key("k3", n)) == by_key
    finally:
        s.close()
