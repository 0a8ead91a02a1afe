"""The disk tier: turns segments' pending records into wheel entries, and wheel refs back into
locations.

A wheel ref is `part_key << 32 | offset`, where `part_key` numbers every (segment, part) pair the
loader has seen. Loading a segment reads its index sidecars (one `numpy.fromfile` per part) and its
dispatch log, and drops records that already have a terminal outcome (delivered, dead-lettered,
cancelled, corrupt). The loader remembers, per part, how far it has loaded, so a record that
arrives after the load is added once and a part published by another writer is picked up by
`refresh`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from storage import TERMINAL, ScheduleStore, record_keys

_OFFSET_MASK = np.uint64(0xFFFFFFFF)
_SHIFT = np.uint64(32)


@dataclass(slots=True)
class LoadedSegment:
    """What the engine holds of one segment: how far each part is loaded, and what is left."""

    segment_ms: int
    loaded_end: dict[int, int] = field(default_factory=dict)  # part -> first offset not loaded
    outstanding: int = 0  # loaded or added, without a terminal outcome yet


class SegmentLoader:
    """Loads segments from a store and translates between refs and (segment, part, offset)."""

    def __init__(self, store: ScheduleStore) -> None:
        self.store = store
        self._key_of: dict[tuple[int, int], int] = {}
        self._seg_of_key = np.empty(0, np.int64)
        self._part_of_key = np.empty(0, np.uint16)
        self.loaded: dict[int, LoadedSegment] = {}

    def part_key(self, segment_ms: int, part: int) -> int:
        """The key of a (segment, part) pair, assigned on first sight."""
        key = self._key_of.get((segment_ms, part))
        if key is None:
            key = self._key_of[(segment_ms, part)] = len(self._key_of)
            self._seg_of_key = np.append(self._seg_of_key, segment_ms)
            self._part_of_key = np.append(self._part_of_key, np.uint16(part))
        return key

    def refs(self, segment_ms: int, parts: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """Refs of records of one segment."""
        if len(parts) == 0:
            return np.empty(0, np.uint64)
        lo, hi = int(parts.min()), int(parts.max())
        if lo == hi:
            return np.uint64(self.part_key(segment_ms, lo)) << _SHIFT | offsets.astype(np.uint64)
        table = np.zeros(hi + 1, np.uint64)
        for p in np.flatnonzero(np.bincount(parts, minlength=hi + 1)).tolist():
            table[p] = self.part_key(segment_ms, p)
        return (table[parts] << _SHIFT) | offsets.astype(np.uint64)

    def locate(self, refs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(segment_ms, part, offset) arrays of refs."""
        keys = (refs >> _SHIFT).astype(np.int64)
        return self._seg_of_key[keys], self._part_of_key[keys], (refs & _OFFSET_MASK).astype(np.uint32)

    def load(self, segment_ms: int) -> tuple[np.ndarray, np.ndarray]:
        """Pending (due, refs) of a segment not loaded yet; marks it loaded once they are read (a
        load that fails leaves it not loaded, to be loaded whole again)."""
        if segment_ms in self.loaded:
            raise ValueError(f"segment {segment_ms} is already loaded")
        seg = LoadedSegment(segment_ms)
        got = self._load_parts(seg, None)
        self.loaded[segment_ms] = seg
        return got

    def refresh(self, segment_ms: int) -> tuple[np.ndarray, np.ndarray]:
        """Pending (due, refs) of parts that appeared in a loaded segment since it was loaded."""
        seg = self.loaded[segment_ms]
        new_parts = [p for p in self.store.layout.list_parts(segment_ms) if p not in seg.loaded_end]
        if not new_parts:
            return np.empty(0, np.int64), np.empty(0, np.uint64)
        return self._load_parts(seg, new_parts)

    def _load_parts(self, seg: LoadedSegment, parts: list[int] | None) -> tuple[np.ndarray, np.ndarray]:
        """Pending (due, refs) of the parts (None: all), read whole before `seg` is changed: a read
        that fails half way leaves `seg` as it was, so that nothing is counted as loaded unread."""
        ix = self.store.segment_index(seg.segment_ms, parts)
        ends = {p: int(ix.offset[end - 1]) + int(ix.length[end - 1]) if end > start else 0
                for p, start, end in ix.part_ranges}
        if len(ix) == 0:
            seg.loaded_end.update(ends)
            return np.empty(0, np.int64), np.empty(0, np.uint64)
        entries = self.store.dispatch_log(seg.segment_ms).entries
        keep = np.ones(len(ix), bool)
        if len(entries):
            done = entries[np.isin(entries["outcome"], TERMINAL)]
            done_keys = record_keys(done["part"], done["offset"])  # repeats are harmless below
            all_keys = ix.keys()  # ascending: parts in order, offsets ascending within a part
            pos = np.searchsorted(all_keys, done_keys)
            hit = (pos < len(all_keys)) & (all_keys[np.minimum(pos, len(all_keys) - 1)] == done_keys)
            keep[pos[hit]] = False
        if keep.all():  # nothing dispatched yet (the usual preload): no copies through a mask
            due, refs = ix.due_ms, self.refs(seg.segment_ms, ix.part, ix.offset)
        else:
            due = ix.due_ms[keep]
            refs = self.refs(seg.segment_ms, ix.part[keep], ix.offset[keep])
        seg.loaded_end.update(ends)
        seg.outstanding += len(due)
        return due, refs

    def not_covered(self, segment_ms: int, locations: np.ndarray) -> np.ndarray:
        """Of newly stored records (LOCATION_DTYPE) of a loaded segment, those its load did not
        include; counts them as outstanding and moves the loaded ends past them."""
        seg = self.loaded[segment_ms]
        parts = locations["part"]
        first = int(parts[0]) if len(parts) else 0
        if len(parts) and bool((parts == first).all()):  # one part: the usual commit
            offsets = locations["offset"]
            end = seg.loaded_end.get(first, 0)
            if int(offsets.min()) >= end:  # none of them loaded already: every one is new
                seg.loaded_end[first] = max(end, int((offsets.astype(np.int64) + locations["length"]).max()))
                seg.outstanding += len(locations)
                return locations
        keep = np.ones(len(locations), bool)
        for p in np.flatnonzero(np.bincount(parts)).tolist():
            m = parts == p
            end = seg.loaded_end.get(p, 0)
            keep[m] = locations["offset"][m] >= end
            if keep[m].any():
                sel = locations[m & keep]
                seg.loaded_end[p] = max(end, int((sel["offset"].astype(np.int64) + sel["length"]).max()))
        fresh = locations[keep]
        seg.outstanding += len(fresh)
        return fresh

    def note_done(self, done: dict[int, int]) -> None:
        """Terminal outcomes were recorded for records of these segments (how many per segment)."""
        for s, c in done.items():
            seg = self.loaded.get(s)
            if seg is not None:
                seg.outstanding -= c

    def in_segment(self, refs: np.ndarray, segment_ms: int) -> np.ndarray:
        """A mask: which refs are of records of this segment."""
        keys = [k for (seg, _), k in self._key_of.items() if seg == segment_ms]
        return np.isin((refs >> _SHIFT).astype(np.int64), np.array(keys, np.int64))

    def unload(self, segment_ms: int) -> None:
        """Forget a segment (its refs stay decodable)."""
        self.loaded.pop(segment_ms, None)
        self.store.release_segment(segment_ms)
