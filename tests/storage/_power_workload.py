"""A seeded workload of a `ScheduleStore` with flush="sync" under the power-loss model
(`tests/storage/_power_loss.py`), and the check of a store reopened on what a power loss left.

The workload appends (with repeated ids), checkpoints (its own and those a full ingest log
starts), records dispatch outcomes (delivered, retried, cancelled), keeps cancels in the tombstone
log (compacting it now and then), seals live parts, marks segments done and retires them, publishes
backfill parts, and is killed and restarted (the page cache surviving, as a killed process leaves
it). It keeps a ledger of what each call acknowledged by returning.
"""
from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from storage import (CANCELLED, DELIVERED, LOST_QUEUE, NO_QUEUE, RETRIED, TERMINAL, TOMBSTONE_ID, CorruptRecordError,
                     EncodedRecords, PartStager, Record, ScheduleStore, Tombstone, TombstoneLog, dispatch_entries)
from tests.storage._power_loss import DiskModel

START = 1_800_000_000_000
SEGMENT_MINUTES = 1
SEGMENT_MS = SEGMENT_MINUTES * 60_000
FAR = START + 10 ** 12  # tombstones outlive the test
#: sync points after a restart's recovery that are still "near" it (`Workload.near_restart`)
RESTART_SYNCS = 10


def origin_of(msg_id: str) -> tuple[str, int] | None:
    """Where a record came from on the delay topic (None, unknown, for one in five)."""
    n = int(msg_id[1:])
    return None if n % 5 == 0 else (f"broker-{n % 3}:{n % 4}", 1000 + n)


def open_store(data_dir: Path) -> ScheduleStore:
    """The store as the workload and the checks open it: small parts and ingest log files, so
    parts roll and checkpoints start from commits too."""
    return ScheduleStore(data_dir, flush="sync", segment_minutes=SEGMENT_MINUTES, max_part_bytes=6 << 10,
                         checkpoint_bytes=12 << 10)


@dataclass(frozen=True, slots=True)
class Mark:
    """How much of the ledger was acknowledged at a cut."""

    acked: int
    dispatched: int
    tombstones: int
    published: int
    #: segment -> acknowledged records before its retirement began (those may be gone with it)
    retiring: tuple[tuple[int, int], ...]


@dataclass(slots=True)
class Ledger:
    """What was handed to the store, and what it acknowledged, in order."""

    #: every record ever handed to an append or a publish, by id (the first copy: later ones are dropped)
    attempted: dict[str, Record] = field(default_factory=dict)
    acked: list[str] = field(default_factory=list)
    dispatched: list[tuple[int, np.ndarray]] = field(default_factory=list)
    tombstones: list[Tombstone] = field(default_factory=list)
    published: list[tuple[int, list[str]]] = field(default_factory=list)
    retiring: dict[int, int] = field(default_factory=dict)

    def mark(self) -> Mark:
        """The ledger's length now."""
        return Mark(len(self.acked), len(self.dispatched), len(self.tombstones), len(self.published),
                    tuple(sorted(self.retiring.items())))


class Workload:
    """Drives one store through `steps` seeded operations."""

    def __init__(self, model: DiskModel, rng: random.Random) -> None:
        self.model = model
        self.rng = rng
        self.dir = model.root
        self.ledger = Ledger()
        self.now = START
        self._n = 0
        self.kills = 0
        #: the restart after a kill is recovering, or has just recovered up to this many sync points
        self.recovering = False
        self._settled_at = -1

    def run(self, steps: int) -> None:
        """Open the store, run `steps` operations, then close it."""
        self.store = open_store(self.dir)
        self.tombs = TombstoneLog(self.dir, sync=True)
        ops = [(self.append, 40), (self.tick, 12), (self.checkpoint, 4), (self.deliver, 10), (self.cancel, 5),
               (self.seal, 3), (self.retire, 4), (self.publish, 2), (self.compact, 1), (self.kill, 2)]
        funcs, weights = zip(*ops)
        for _ in range(steps):
            self.rng.choices(funcs, weights)[0]()
        self.store.close()
        self.tombs.close()

    # ---- operations -----------------------------------------------------------------------------

    def _new_record(self, late_ok: bool = True) -> Record:
        self._n += 1
        low = -2 * SEGMENT_MS if late_ok and self.rng.random() < 0.1 else 0
        due = self.now + self.rng.randint(low, 4 * SEGMENT_MS)
        rec = Record(f"m{self._n}", "T", self.rng.randbytes(self.rng.randint(0, 300)), due,
                     keys=(f"k{self._n % 5}",) if self.rng.random() < 0.5 else ())
        self.ledger.attempted[rec.msg_id] = rec
        return rec

    def near_restart(self) -> bool:
        """Whether a restart after a kill is recovering, or recovered a few sync points ago: the
        names a killed process left in the page cache only are at stake then."""
        return self.recovering or self.model.syncs < self._settled_at

    def append(self) -> None:
        """One batch, now and then with ids stored before or repeated within it."""
        batch = [self._new_record() for _ in range(self.rng.randint(1, 12))]
        if self.ledger.acked and self.rng.random() < 0.2:
            batch.append(self.ledger.attempted[self.rng.choice(self.ledger.acked)])
        if self.rng.random() < 0.1:
            batch.append(batch[0])
        if self.rng.random() < 0.5:
            res = self.store.append(batch, self.now, [origin_of(r.msg_id) for r in batch])
        else:
            rows = EncodedRecords()
            rows.extend_unencoded(batch, [origin_of(r.msg_id) for r in batch])
            res = self.store.append_encoded(rows, self.now)
        seen: set[str] = set()
        for rec, new in zip(batch, res.new.tolist()):
            if new and rec.msg_id not in seen:
                seen.add(rec.msg_id)
                self.ledger.acked.append(rec.msg_id)

    def tick(self) -> None:
        """Time passes."""
        self.now += self.rng.randint(1_000, 40_000)

    def checkpoint(self) -> None:
        """The housekeeper's checkpoint."""
        self.store.checkpoint()

    def _pending(self, seg: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        ix = self.store.segment_index(seg)
        done = self.store.dispatch_log(seg).entries
        done = done[np.isin(done["outcome"], TERMINAL)]
        keys = ix.keys()
        done_keys = (done["part"].astype(np.uint64) << np.uint64(32)) | done["offset"].astype(np.uint64)
        left = ~np.isin(keys, done_keys)
        return ix.part[left], ix.offset[left], ix.due_ms[left]

    def deliver(self) -> None:
        """Outcomes for some pending records of a segment that is due: delivered, or retried."""
        due = [s for s in self.store.layout.list_segments() if s <= self.now]
        if not due:
            return
        seg = self.rng.choice(due)
        part, offset, due_ms = self._pending(seg)
        if not len(part):
            self.store.mark_segment_done(seg, lambda: True, self.store.layout.list_parts(seg))
            return
        take = np.flatnonzero(np.array([self.rng.random() < 0.7 for _ in range(len(part))], bool))
        outcome = RETRIED if self.rng.random() < 0.15 else DELIVERED
        entries = dispatch_entries(part[take], offset[take], due_ms[take], self.now, outcome)
        self.store.record_dispatch(seg, entries, self.now)
        self.ledger.dispatched.append((seg, entries))

    def cancel(self) -> None:
        """A cancel of a stored record: its outcome in the dispatch log, then its tombstone."""
        if not self.ledger.acked:
            return
        msg_id = self.rng.choice(self.ledger.acked)
        loc = self.store.meta.locations([msg_id])[0]
        if loc is None:
            return  # retired with its segment
        rec = self.ledger.attempted[msg_id]
        entries = dispatch_entries(np.array([loc.part]), np.array([loc.offset]), np.array([rec.due_ms]), self.now,
                                   CANCELLED)
        self.store.record_dispatch(loc.segment_ms, entries, self.now)
        self.ledger.dispatched.append((loc.segment_ms, entries))
        tomb = Tombstone(TOMBSTONE_ID, msg_id, self.now, FAR)
        self.tombs.append([tomb], self.now)
        self.ledger.tombstones.append(tomb)

    def compact(self) -> None:
        """The tombstone log rewritten with every tombstone it holds (none has expired)."""
        self.tombs.rewrite(self.tombs.read().tombstones, self.now)

    def seal(self) -> None:
        """Live parts of ended segments sealed, as the timer does."""
        self.store.seal_live_parts(self.now)

    def retire(self) -> None:
        """Deliver what is left of the ended segments, mark them done, and retire them."""
        began: dict[int, int] = {}
        for seg in self.store.layout.list_segments():
            if seg + SEGMENT_MS > self.now or self.store.is_live(seg):
                continue
            part, offset, due_ms = self._pending(seg)
            if len(part):
                entries = dispatch_entries(part, offset, due_ms, self.now, DELIVERED)
                self.store.record_dispatch(seg, entries, self.now)
                self.ledger.dispatched.append((seg, entries))
            self.store.mark_segment_done(seg, lambda: True, self.store.layout.list_parts(seg))
            began[seg] = len(self.ledger.acked)
        before = dict(self.ledger.retiring)
        self.ledger.retiring.update(began)  # while retention runs, what they held may go
        retired = set(self.store.retire(self.now, 0, archive=self.rng.random() < 0.2))
        for seg in began:  # those that stayed are held to account again
            if seg in retired:
                continue
            if seg in before:
                self.ledger.retiring[seg] = before[seg]
            else:
                del self.ledger.retiring[seg]

    def publish(self) -> None:
        """A backfill part staged beside the store and published into a segment."""
        staging = self.dir / "_staging"
        staging.mkdir(exist_ok=True)
        stager = PartStager(staging, f"job{self._n}", SEGMENT_MS, self.now)
        seg_of: dict[int, list[str]] = {}
        for _ in range(self.rng.randint(1, 8)):
            rec = self._new_record(late_ok=False)
            stager.add(rec)
            seg_of.setdefault(rec.due_ms - rec.due_ms % SEGMENT_MS, []).append(rec.msg_id)
        for part in stager.finish():
            self.store.layout.publish_part(part.segment_ms, part.log, part.index)
            self.ledger.published.append((part.segment_ms, seg_of[part.segment_ms]))

    def kill(self) -> None:
        """The process dies (its page cache stays) and starts again: no checkpoint, no flush."""
        kill(self.store, self.model)
        if self.tombs._fd is not None:
            os.close(self.tombs._fd)
            self.tombs._fd = None
        self.kills += 1
        self.recovering = True
        self.store = open_store(self.dir)
        self.recovering = False
        self._settled_at = self.model.syncs + RESTART_SYNCS
        self.tombs = TombstoneLog(self.dir, sync=True)
        self.tombs.read()


def kill(store: ScheduleStore, model: DiskModel) -> None:
    """Drop `store` as a killed process would: its files closed, no checkpoint; its meta store as its
    directory stood (closing RocksDB flushes what the process would have lost: that copy goes back)."""
    kept = model.copy_meta()
    assert kept is not None
    store._closed = True
    store._close_files()
    shutil.rmtree(model.meta_dir)
    shutil.copytree(kept, model.meta_dir)


# ---- the check of a reopened store ----------------------------------------------------------------


def verify(data_dir: Path, ledger: Ledger, mark: Mark) -> list[str]:
    """What a store reopened on `data_dir` lost or served wrong of what was acknowledged by `mark`,
    the records' origins included."""
    try:
        store = open_store(data_dir)
    except Exception as e:  # a store that cannot open is the finding
        return [f"the store does not open: {type(e).__name__}: {e}"]
    problems: list[str] = []
    retiring = dict(mark.retiring)

    def exempt(seg: int, acked_at: int) -> bool:
        return seg in retiring and acked_at < retiring[seg]

    try:
        served = _served(store, ledger, problems)
        expected = [(i, m) for i, m in enumerate(ledger.acked[:mark.acked])]
        locs = store.meta.locations([m for _, m in expected])
        held: list[tuple[str, int, int, int]] = []  # records read back whole: their origins are checked
        for (i, msg_id), loc in zip(expected, locs):
            rec = ledger.attempted[msg_id]
            seg = rec.due_ms - rec.due_ms % SEGMENT_MS
            if exempt(seg, i):
                continue
            if loc is None:
                problems.append(f"acknowledged record {msg_id} (segment {seg}) is not in the meta store")
                continue
            try:
                got = store.read_record(loc.segment_ms, loc.part, loc.offset)
            except CorruptRecordError as e:
                problems.append(f"acknowledged record {msg_id} reads as corrupt: {e}")
                continue
            if (got.msg_id, got.body, got.due_ms) != (msg_id, rec.body, rec.due_ms):
                problems.append(f"acknowledged record {msg_id}: its location holds {got.msg_id}")
            elif (loc.segment_ms, loc.part, loc.offset) not in served.get(msg_id, ()):
                problems.append(f"acknowledged record {msg_id} is not in its segment's index (never sent)")
            else:
                held.append((msg_id, loc.segment_ms, loc.part, loc.offset))
        problems += _wrong_origins(store, held)
        for seg, ids in ledger.published[:mark.published]:
            for msg_id in ids:
                if not served.get(msg_id) and seg not in retiring:
                    problems.append(f"published record {msg_id} (segment {seg}) is gone")
        for seg, entries in ledger.dispatched[:mark.dispatched]:
            if seg in retiring:
                continue
            have = store.dispatch_log(seg).entries
            have_keys = set(zip(have["part"].tolist(), have["offset"].tolist(), have["outcome"].tolist()))
            for row in zip(entries["part"].tolist(), entries["offset"].tolist(), entries["outcome"].tolist()):
                if row not in have_keys:
                    problems.append(f"segment {seg}: acknowledged outcome {row[2]} of record {row[0]}/{row[1]} "
                                    "is gone from its dispatch log")
    finally:
        store.close()
    kept = {(t.kind, t.text) for t in TombstoneLog(data_dir).read().tombstones}
    for t in ledger.tombstones[:mark.tombstones]:
        if (t.kind, t.text) not in kept:
            problems.append(f"acknowledged tombstone of {t.text} is gone")
    return problems


def _served(store: ScheduleStore, ledger: Ledger, problems: list[str]) -> dict[str, set[tuple[int, int, int]]]:
    """Every record the segments' indexes serve, by id; a good record that is not one handed to
    the store is a problem (a corrupt one must be reported as such, never served)."""
    out: dict[str, set[tuple[int, int, int]]] = {}
    for seg in store.layout.list_segments():
        ix = store.segment_index(seg)
        recs = store.read_records([seg] * len(ix), ix.part.tolist(), ix.offset.tolist(), ix.due_ms.tolist())
        for part, off, got in zip(ix.part.tolist(), ix.offset.tolist(), recs):
            if isinstance(got, CorruptRecordError):
                continue
            want = ledger.attempted.get(got.msg_id)
            if want is None or (want.body, want.due_ms) != (got.body, got.due_ms):
                problems.append(f"segment {seg} part {part} offset {off} serves {got.msg_id!r}, "
                                "which was never stored with those bytes")
                continue
            out.setdefault(got.msg_id, set()).add((seg, part, off))
    return out


def _wrong_origins(store: ScheduleStore, held: list[tuple[str, int, int, int]]) -> list[str]:
    """Records' origins (id, segment, part, offset each) are read back as they were given, or as lost
    (a sidecar row a power loss took, or left as zeros), never as another queue or offset, nor as
    unknown (a replica set judges those by the watermark alone)."""
    if not held:
        return []
    ids, segs, parts, offsets = zip(*held)
    rows = store.read_origins(np.array(segs, np.int64), np.array(parts, np.int64), np.array(offsets, np.int64))
    names = store.queues.names()
    out = []
    for msg_id, queue, offset in zip(ids, rows["queue"].tolist(), rows["offset"].tolist()):
        if queue == LOST_QUEUE:
            continue
        if queue == NO_QUEUE:
            if origin_of(msg_id) is not None:
                out.append(f"acknowledged record {msg_id} reads as of unknown origin, not {origin_of(msg_id)} or lost")
            continue
        got = (names[queue] if queue < len(names) else f"queue number {queue}", offset)
        if got != origin_of(msg_id):
            out.append(f"acknowledged record {msg_id} reads as from {got}, not {origin_of(msg_id)}")
    return out
