"""The in-memory hash wheel: entries released at their exact due millisecond.

A pure data structure over numpy arrays. It owns no thread and reads no clock; the engine drives
it from one thread with an injected clock. See `TimeWheel` for the algorithm, its costs, a worked
example and the thread-safety rule. It is longer than the other modules on purpose: one cohesive
data structure, half of it the explanation and the argument checks, split nowhere without
splitting the invariants that `check()` audits.
"""

from __future__ import annotations

import operator

import numpy as np

__all__ = ["ADDED", "BEYOND", "EXPIRED", "TimeWheel"]

ADDED = 0
"""`TimeWheel.add` status: the entry is held and `pop_due` will release it."""
EXPIRED = 1
"""`TimeWheel.add` status: due before the wheel's time, already passed; deliver it directly."""
BEYOND = 2
"""`TimeWheel.add` status: due at or after the horizon; keep it in the disk tier for now."""

_TIME_LIMIT = 1 << 62  # |start_ms|, |now_ms| bound, so that time + span never overflows int64
_SPAN_LIMIT = 1 << 61  # tick_ms * slots bound, for the same reason
_INT64_MAX = np.iinfo(np.int64).max


class TimeWheel:
    """A wheel of `slots` slots of `tick_ms` that releases each entry at its exact due millisecond.

    An entry is a due time (int64 UTC epoch ms) and an opaque reference (uint64; the engine packs
    a disk location into it). Entries live in numpy arrays, never one Python object each: a held
    entry costs 16 bytes.

    Time. `time_ms` is the first millisecond not yet released: `start_ms` at first, `now_ms + 1`
    after `pop_due(now_ms)`. The cursor is the start of the slot holding it,
    `cursor_ms = floor(time_ms / tick_ms) * tick_ms`, and the horizon is
    `horizon_ms = cursor_ms + slots * tick_ms`. `add` holds entries due in
    `[time_ms, horizon_ms)`; it answers EXPIRED for one due before `time_ms` (`pop_due` is past
    it already: the caller delivers it now, as Kafka's `add()` answering false) and BEYOND for one
    due at or after the horizon (the caller keeps it on disk). A slot is counted from the cursor,
    `(due - cursor_ms) // tick_ms`, never as `(now + delay // tick) % slots`: a delay longer than
    one rotation is BEYOND, it cannot fire a rotation early. Advancing the cursor moves the
    horizon with it; that is how the ring frees its slots.

    Layout. Three tiers, disjoint in time:

    - the head: every entry of the cursor's slot, sorted by due (ties in insertion order), with a
      read position. `pop_due` inside that slot is a binary search and a copy of the prefix;
      `next_due_ms` reads the first live entry.
    - runs: entries of later slots, each run *bucketed*, that is stable-sorted by slot but not by
      due: all entries of slot s come before those of slot s + 1, in insertion order within a
      slot. A slot boundary splits a bucketed array into a prefix below it and a suffix above it,
      so `np.searchsorted(due, boundary)` finds slot ranges without an offsets table. A run is cut
      at slot boundaries into chunks of about 1 Mi entries: a chunk the cursor has passed is
      freed whole, and copying a drained prefix away (see memory below) never moves more than one
      chunk, so a pop stalls for at most a few ms however much is loaded. Chunks are that big
      because numpy asks for transparent huge pages from 4 MiB up: with 64 Ki-entry chunks a bulk
      add of a million faulted in 4 KiB pages and took 32 ms instead of 22 here.
    - staging: up to 4096 entries of later slots, unsorted, in insertion order. The ingest of late
      arrivals (batches of 1-100) lands here; when it would overflow it is bucketed into a run.
      A larger add becomes a run at once.

    Every entry of a run was added before every entry of the next run, and staging is newer than
    all runs; so gathering oldest first and sorting stably by due keeps ties in insertion order.
    Adjacent runs merge as a binary counter carries (when the newer holds more than half as many
    as the older, up to 256 Ki entries together), and beyond 12 runs the smallest adjacent pair
    merges: there are only ever a few runs.

    Bucketing is a stable argsort of the slot number as uint16, which numpy does as a radix sort,
    O(n), then a gather (a wheel of more than 65536 slots takes two 16-bit passes). There is no
    comparison sort of due times: exact due order is only established one slot at a time, when
    the slot becomes the head, or for the slots a jump crosses at once (radix passes again; only
    keys spanning over 2**32, a jump of more than 49 days, fall back to numpy's stable sort).

    Advancing. `pop_due(now_ms)` with `now_ms` in the cursor's slot consumes a prefix of the head.
    Once `now_ms` reaches a later slot, each run (one binary search per run) and staging give up
    their entries below the end of now's slot, the rest of the head joins them, one stable sort by
    due orders them (16-bit radix passes when there are many), the part due by `now_ms` is
    released and the remainder is the new head. A jump across many slots (catch-up after a pause)
    is therefore one gather and one sort, not a loop over slots.

    Costs, for n entries added, k released, h in the head, R runs, N held:

    - `add`: O(n) bucketing, plus merges that move an entry O(log(N / 4096)) times in all;
      entries for the cursor's slot re-sort the head, O(h + n).
    - `pop_due` within the cursor's slot: O(log h + k). Into a later slot: O(R log N) searches
      plus sorting the m entries of the slots crossed, O(m) by radix when m is large.
    - `next_due_ms`: O(1), the head's first entry or a cached minimum of the later tiers.
    - `remove`: O(N), `np.isin` over every array; it serves cancels, which can be most messages
      (orders paid before their timeout), so the timer removes them in batches (`timewheel.timer`).
    - memory: 16 bytes per held entry, plus the drained prefix of the head and of each run's
      first chunk, copied away once it exceeds a quarter of what is left: at most 20 bytes per
      entry, exactly 16 after a bulk add to an empty wheel.

    Worked example, a wheel of 8 slots of 500 ms started at 1000, so spanning [1000, 5000):

    >>> w = TimeWheel(tick_ms=500, slots=8, start_ms=1_000)
    >>> w.cursor_ms, w.horizon_ms
    (1000, 5000)
    >>> due = np.array([1_200, 1_700, 1_250, 900, 5_000, 1_700], dtype=np.int64)
    >>> w.add(due, np.arange(6, dtype=np.uint64)).tolist()   # 900: EXPIRED, 5000: BEYOND
    [0, 0, 0, 1, 2, 0]

    1200 and 1250 (refs 0, 2) are in the cursor's slot [1000, 1500), so in the head; both 1700s
    (refs 1, 5) wait in staging for slot [1500, 2000).

    >>> w.next_due_ms()
    1200
    >>> [a.tolist() for a in w.pop_due(1_210)]   # mid-slot: only what is due by 1210
    [[1200], [0]]
    >>> [a.tolist() for a in w.pop_due(1_700)]   # crosses into [1500, 2000); ties in add order
    [[1250, 1700, 1700], [2, 1, 5]]
    >>> w.time_ms, w.cursor_ms, w.horizon_ms, len(w)
    (1701, 1500, 5500, 0)
    >>> w.add(np.array([5_000, 1_700]), np.array([6, 7], dtype=np.uint64)).tolist()
    [0, 1]

    The horizon moved with the cursor, so 5000 is now held; 1700 is EXPIRED, as `pop_due(1700)`
    has already released everything due by then.

    Thread safety: none. The wheel is not thread-safe and takes no lock; the engine owns it and
    calls it from one thread only (the driver loop), handing adds and cancels to that thread.
    """

    # Tuning, as class attributes so that tests can shrink them in a subclass to reach every path.
    _CHUNK_ENTRIES = 1 << 20  # a run is cut at slot boundaries into chunks of about this many
    _STAGING_MAX = 4096  # staging is bucketed into a run when it would hold more than this
    _MERGE_CAP = 1 << 18  # binary-counter merges only while two runs hold this many together
    _MAX_RUNS = 12  # beyond this many runs the smallest adjacent pair merges regardless
    _RADIX_MIN = 256  # below this many keys a plain stable argsort beats the radix passes
    _SLACK = 4  # a drained prefix is copied away once it exceeds 1/_SLACK of the live entries

    def __init__(self, tick_ms: int = 500, slots: int = 16384, start_ms: int = 0) -> None:
        """Create an empty wheel whose time is `start_ms`."""
        tick = _as_int("tick_ms", tick_ms)
        nslots = _as_int("slots", slots)
        start = _as_int("start_ms", start_ms)
        if tick < 1:
            raise ValueError(f"tick_ms must be at least 1, got {tick}")
        if nslots < 1:
            raise ValueError(f"slots must be at least 1, got {nslots}")
        if tick * nslots > _SPAN_LIMIT:
            raise ValueError(f"tick_ms * slots must be at most 2**61 ms, got {tick * nslots}")
        if abs(start) > _TIME_LIMIT:
            raise ValueError(f"start_ms must be within +-2**62, got {start}")
        self._tick = tick
        self._slots = nslots
        self._time = start
        self._cursor = start // tick * tick
        self._count = 0
        # head: the cursor's slot, sorted by due; entries before _head_pos are released
        self._head_due = _empty_due()
        self._head_refs = _empty_refs()
        self._head_pos = 0
        # runs: later slots, bucketed, oldest first
        self._runs: list[_Run] = []
        # staging: later slots, unsorted batches, oldest first
        self._stage_due: list[np.ndarray] = []
        self._stage_refs: list[np.ndarray] = []
        self._stage_len = 0
        # earliest due in runs and staging (None: they are empty); recomputed when stale
        self._later_min: int | None = None
        self._later_min_stale = False

    # -- properties ---------------------------------------------------------------------------

    @property
    def tick_ms(self) -> int:
        """Width of a slot in milliseconds."""
        return self._tick

    @property
    def slots(self) -> int:
        """Number of slots; the wheel spans slots * tick_ms from the cursor."""
        return self._slots

    @property
    def time_ms(self) -> int:
        """First millisecond not yet released; entries due before it are EXPIRED."""
        return self._time

    @property
    def cursor_ms(self) -> int:
        """Start of the slot holding time_ms (a multiple of tick_ms)."""
        return self._cursor

    @property
    def horizon_ms(self) -> int:
        """End of the span the wheel accepts; entries due at or after it are BEYOND."""
        return self._cursor + self._slots * self._tick

    @property
    def nbytes(self) -> int:
        """Bytes held by the wheel's arrays, released prefixes included."""
        total = self._head_due.nbytes + self._head_refs.nbytes
        for run in self._runs:
            for chunk in run.chunks:
                total += chunk.due.nbytes + chunk.refs.nbytes
        for d, r in zip(self._stage_due, self._stage_refs):
            total += d.nbytes + r.nbytes
        return total

    def __len__(self) -> int:
        """Number of entries held."""
        return self._count

    def __repr__(self) -> str:
        """Summary of the wheel's geometry, time and size."""
        return (
            f"TimeWheel(tick_ms={self._tick}, slots={self._slots}, time_ms={self._time}, "
            f"cursor_ms={self._cursor}, len={self._count}, runs={len(self._runs)})"
        )

    # -- operations ---------------------------------------------------------------------------

    def add(self, due_ms: np.ndarray, refs: np.ndarray) -> np.ndarray:
        """Hold entries due in [time_ms, horizon_ms); return ADDED, EXPIRED or BEYOND per entry."""
        due, ref = _entries(due_ms, refs)
        status = np.zeros(len(due), dtype=np.uint8)
        if not len(due):
            return status
        horizon = self.horizon_ms
        if int(due.min()) < self._time or int(due.max()) >= horizon:
            status[due < self._time] = EXPIRED
            status[due >= horizon] = BEYOND
            keep = status == ADDED
            due, ref = due[keep], ref[keep]
            if not len(due):
                return status
        self._count += len(due)
        head_end = self._cursor + self._tick
        if int(due.min()) < head_end:
            now_slot = due < head_end
            self._head_insert(due[now_slot], ref[now_slot])
            later = ~now_slot
            due, ref = due[later], ref[later]
        if len(due):
            self._add_later(due, ref)
        return status

    def pop_due(self, now_ms: int) -> tuple[np.ndarray, np.ndarray]:
        """Remove and return (due int64, refs uint64) of every entry due by now_ms, in due order.

        Ties come out in insertion order. `now_ms` is expected not to decrease; one before
        `time_ms` (at or before an earlier call's) releases nothing and changes nothing.
        """
        now = _as_int("now_ms", now_ms)
        if abs(now) > _TIME_LIMIT:
            raise ValueError(f"now_ms must be within +-2**62, got {now}")
        if now < self._time:
            return _empty_due(), _empty_refs()
        self._time = now + 1
        cursor = self._time // self._tick * self._tick
        if cursor == self._cursor:
            return self._pop_head(now)
        return self._advance(now, cursor)

    def next_due_ms(self) -> int | None:
        """Earliest due time held, exactly, or None when the wheel is empty."""
        if self._head_pos < len(self._head_due):
            return int(self._head_due[self._head_pos])
        if self._later_min_stale:
            self._later_min = self._scan_later_min()
            self._later_min_stale = False
        return self._later_min

    def remove(self, refs: np.ndarray) -> int:
        """Remove every held entry whose ref is in refs; return how many were removed."""
        gone = _refs("refs", _int_array("refs", refs))
        if not len(gone) or not self._count:
            return 0
        removed = 0
        live_due = self._head_due[self._head_pos :]
        live_refs = self._head_refs[self._head_pos :]
        hit = np.isin(live_refs, gone)
        hits = int(np.count_nonzero(hit))
        if hits:
            keep = ~hit
            self._set_head(live_due[keep], live_refs[keep])
            removed += hits
        for run in self._runs:
            removed += run.remove(gone)
        self._runs = [run for run in self._runs if run.live]
        if self._stage_len:
            due, ref = self._stage_arrays()
            hit = np.isin(ref, gone)
            hits = int(np.count_nonzero(hit))
            if hits:
                keep = ~hit
                self._set_stage(due[keep], ref[keep])
                removed += hits
        if removed:
            self._count -= removed
            self._later_min_stale = True
        return removed

    def check(self) -> list[str]:
        """Audit the internal invariants; return the problems found (empty when sound)."""
        problems: list[str] = []
        tick, cursor, horizon = self._tick, self._cursor, self.horizon_ms
        head_end = cursor + tick
        arrays = [("head", self._head_due, self._head_refs)]
        hd = self._head_due[self._head_pos :]
        if len(hd):
            if np.any(hd[1:] < hd[:-1]):
                problems.append("head is not sorted by due")
            if int(hd[0]) < self._time or int(hd[-1]) >= head_end:
                problems.append("head holds entries outside [time_ms, cursor_ms + tick_ms)")
        if self._head_pos * self._SLACK > len(hd) and self._head_pos:
            problems.append("head's released prefix was not copied away")
        later_min: int | None = None
        counted = len(hd)
        for i, run in enumerate(self._runs):
            if not run.chunks or run.live != sum(len(c.due) - c.pos for c in run.chunks):
                problems.append(f"run {i}: live count {run.live} is wrong")
            last_slot = None
            for c in run.chunks:
                arrays.append((f"run {i} chunk", c.due, c.refs))
                d = c.due[c.pos :]
                if not len(d):
                    problems.append(f"run {i}: an empty chunk is kept")
                    continue
                if c.pos * self._SLACK > len(d):
                    problems.append(f"run {i}: a chunk's released prefix was not copied away")
                keys = (d - cursor) // tick
                if np.any(keys[1:] < keys[:-1]):
                    problems.append(f"run {i} is not bucketed by slot")
                if last_slot is not None and keys[0] <= last_slot:
                    problems.append(f"run {i}: chunks are not cut at slot boundaries")
                if int(d.min()) < head_end or int(d.max()) >= horizon:
                    problems.append(f"run {i} holds entries outside the later slots")
                last_slot = int(keys[-1])
                later_min = _min_of(later_min, int(d.min()))
            counted += run.live
        if self._stage_len != sum(len(d) for d in self._stage_due):
            problems.append("staging count is wrong")
        for d, r in zip(self._stage_due, self._stage_refs):
            arrays.append(("staging", d, r))
            if len(d):
                if int(d.min()) < head_end or int(d.max()) >= horizon:
                    problems.append("staging holds entries outside the later slots")
                later_min = _min_of(later_min, int(d.min()))
        counted += self._stage_len
        if counted != self._count:
            problems.append(f"len is {self._count} but {counted} entries are held")
        if not self._later_min_stale and self._later_min != later_min:
            problems.append(f"cached later minimum {self._later_min} is not {later_min}")
        for where, d, r in arrays:
            if d.dtype != np.int64 or r.dtype != np.uint64 or d.shape != r.shape:
                problems.append(f"{where}: arrays are {d.dtype}{d.shape} and {r.dtype}{r.shape}")
            if d.base is not None or r.base is not None:
                problems.append(f"{where}: an array is a view, so nbytes undercounts")
        return problems

    # -- internals ----------------------------------------------------------------------------

    def _head_insert(self, due: np.ndarray, ref: np.ndarray) -> None:
        """Merge entries of the cursor's slot into the head, after equal due times already there."""
        pos = self._head_pos
        d = np.concatenate((self._head_due[pos:], due))
        r = np.concatenate((self._head_refs[pos:], ref))
        if len(due) < self._RADIX_MIN:  # a sorted run and a short tail: timsort merges them
            order = np.argsort(d, kind="stable")
        else:
            low = int(d.min())
            order = _stable_argsort(d - low, int(d.max()) - low + 1, self._RADIX_MIN)
        self._set_head(d.take(order), r.take(order))

    def _set_head(self, due: np.ndarray, ref: np.ndarray) -> None:
        """Replace the head with arrays the wheel owns."""
        self._head_due, self._head_refs, self._head_pos = due, ref, 0

    def _pop_head(self, now: int) -> tuple[np.ndarray, np.ndarray]:
        """Release the head's prefix due by now (the cursor has not moved)."""
        pos = self._head_pos
        end = int(self._head_due.searchsorted(now, side="right"))  # the method: no Python wrapper
        if end <= pos:
            return _empty_due(), _empty_refs()
        out = self._head_due[pos:end].copy(), self._head_refs[pos:end].copy()
        self._count -= end - pos
        self._head_pos = end
        live = len(self._head_due) - end
        if end * self._SLACK > live:
            self._set_head(self._head_due[end:].copy(), self._head_refs[end:].copy())
        return out

    def _advance(self, now: int, cursor: int) -> tuple[np.ndarray, np.ndarray]:
        """Move the cursor to `cursor`: release what is due by now, load the new head."""
        bound = cursor + self._tick
        parts_due = [self._head_due[self._head_pos :]]
        parts_refs = [self._head_refs[self._head_pos :]]
        moved = 0
        for run in self._runs:  # oldest first, so that ties stay in insertion order
            moved += run.take_below(bound, parts_due, parts_refs, self._SLACK)
        if moved:
            self._runs = [run for run in self._runs if run.live]
        if self._stage_len:
            due, ref = self._stage_arrays()
            below = due < bound
            taken = int(np.count_nonzero(below))
            if taken:
                parts_due.append(due[below])
                parts_refs.append(ref[below])
                above = ~below
                self._set_stage(due[above], ref[above])
                moved += taken
        if moved:
            self._later_min_stale = True
        self._cursor = cursor
        due = np.concatenate(parts_due)
        ref = np.concatenate(parts_refs)
        if not len(due):
            self._set_head(_empty_due(), _empty_refs())
            return _empty_due(), _empty_refs()
        low = int(due.min())
        order = _stable_argsort(due - low, int(due.max()) - low + 1, self._RADIX_MIN)
        k = int(np.count_nonzero(due <= now))
        out, rest = order[:k], order[k:]
        self._set_head(due.take(rest), ref.take(rest))
        self._count -= k
        return due.take(out), ref.take(out)

    def _add_later(self, due: np.ndarray, ref: np.ndarray) -> None:
        """Hold entries of slots after the cursor's: into staging, or bucketed into a run."""
        if not self._later_min_stale:
            self._later_min = _min_of(self._later_min, int(due.min()))
        n = len(due)
        if self._stage_len + n <= self._STAGING_MAX:
            self._stage_due.append(due)
            self._stage_refs.append(ref)
            self._stage_len += n
            return
        if self._stage_len:
            sd, sr = self._stage_arrays()
            self._set_stage(_empty_due(), _empty_refs())
            if n > self._STAGING_MAX:  # large: staging becomes a run of its own, then the batch
                self._push_run(self._bucket(sd, sr))
            else:
                due, ref = np.concatenate((sd, due)), np.concatenate((sr, ref))
        self._push_run(self._bucket(due, ref))

    def _stage_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Staging as one pair of arrays (batches concatenated in order)."""
        if len(self._stage_due) != 1:
            self._set_stage(np.concatenate(self._stage_due), np.concatenate(self._stage_refs))
        return self._stage_due[0], self._stage_refs[0]

    def _set_stage(self, due: np.ndarray, ref: np.ndarray) -> None:
        """Replace staging with one pair of arrays (or nothing, when empty)."""
        self._stage_due = [due] if len(due) else []
        self._stage_refs = [ref] if len(due) else []
        self._stage_len = len(due)

    def _bucket(self, due: np.ndarray, ref: np.ndarray) -> _Run:
        """Bucket entries of later slots by slot into a run, cut into chunks at slot boundaries."""
        keys = (due - self._cursor) // self._tick
        n = len(keys)
        order = None
        if n > 1 and bool(np.any(keys[1:] < keys[:-1])):
            order = _stable_argsort(keys, self._slots, self._RADIX_MIN)
        size = self._CHUNK_ENTRIES
        cuts = [0, n]
        if n > size:
            skeys = keys if order is None else keys.take(order)
            starts = np.searchsorted(skeys, skeys[np.arange(size, n, size)], side="left")
            cuts = [0, *(c for c in np.unique(starts).tolist() if c > 0), n]
        chunks = []
        for a, b in zip(cuts[:-1], cuts[1:]):
            if order is not None:
                idx = order[a:b]
                chunks.append(_Chunk(due.take(idx), ref.take(idx)))
            elif a == 0 and b == n:
                chunks.append(_Chunk(due, ref))  # already bucketed, and ours (see _entries)
            else:
                chunks.append(_Chunk(due[a:b].copy(), ref[a:b].copy()))
        return _Run(chunks, n)

    def _push_run(self, run: _Run) -> None:
        """Append the newest run, then merge adjacent runs to keep them few."""
        runs = self._runs
        runs.append(run)
        while len(runs) >= 2:
            older, newer = runs[-2].live, runs[-1].live
            if older >= 2 * newer or older + newer > self._MERGE_CAP:
                break
            self._merge(len(runs) - 2)
        while len(runs) > self._MAX_RUNS:
            sizes = [a.live + b.live for a, b in zip(runs[:-1], runs[1:])]
            self._merge(sizes.index(min(sizes)))

    def _merge(self, i: int) -> None:
        """Merge runs i and i + 1 (adjacent, so insertion order between runs holds)."""
        chunks = self._runs[i].chunks + self._runs[i + 1].chunks
        due = np.concatenate([c.due[c.pos :] for c in chunks])
        ref = np.concatenate([c.refs[c.pos :] for c in chunks])
        self._runs[i : i + 2] = [self._bucket(due, ref)]

    def _scan_later_min(self) -> int | None:
        """Earliest due in runs and staging: the first slot of each run, and all of staging."""
        best: int | None = None
        tick, cursor = self._tick, self._cursor
        for run in self._runs:
            first = run.chunks[0]
            slot_end = (int(first.due[first.pos]) - cursor) // tick * tick + cursor + tick
            best = _min_of(best, run.min_below(slot_end))
        if self._stage_len:
            best = _min_of(best, int(self._stage_arrays()[0].min()))
        return best


class _Chunk:
    """A bucketed piece of a run; entries before `pos` have left it."""

    __slots__ = ("due", "pos", "refs")

    def __init__(self, due: np.ndarray, refs: np.ndarray) -> None:
        """Wrap arrays the wheel owns."""
        self.due = due
        self.refs = refs
        self.pos = 0

    def drop_prefix(self, k: int, slack: int) -> None:
        """Advance past k entries; copy the rest away once the dead prefix outgrows it."""
        self.pos += k
        if self.pos * slack > len(self.due) - self.pos:
            self.due = self.due[self.pos :].copy()
            self.refs = self.refs[self.pos :].copy()
            self.pos = 0


class _Run:
    """Entries bucketed by slot, as chunks in slot order; `live` counts what is left."""

    __slots__ = ("chunks", "live")

    def __init__(self, chunks: list[_Chunk], live: int) -> None:
        """Wrap chunks in slot order holding `live` entries."""
        self.chunks = chunks
        self.live = live

    def take_below(self, bound: int, out_due: list, out_refs: list, slack: int) -> int:
        """Move entries due before the slot boundary `bound` to the out lists; return how many."""
        taken = 0
        while self.chunks:
            c = self.chunks[0]
            if int(c.due[-1]) < bound:  # the last entry is in the chunk's last slot: all below
                out_due.append(c.due[c.pos :])
                out_refs.append(c.refs[c.pos :])
                taken += len(c.due) - c.pos
                del self.chunks[0]
                continue
            k = int(np.searchsorted(c.due[c.pos :], bound))  # bound splits a bucketed array
            if k:
                out_due.append(c.due[c.pos : c.pos + k])
                out_refs.append(c.refs[c.pos : c.pos + k])
                taken += k
                c.drop_prefix(k, slack)
            break
        self.live -= taken
        return taken

    def min_below(self, bound: int) -> int | None:
        """Earliest due among the entries below the slot boundary `bound`."""
        best: int | None = None
        for c in self.chunks:
            d = c.due[c.pos :]
            if int(d[0]) >= bound:
                break
            best = _min_of(best, int(d[: int(np.searchsorted(d, bound))].min()))
        return best

    def remove(self, gone: np.ndarray) -> int:
        """Drop entries whose ref is in `gone`; return how many (bucketing is kept)."""
        removed = 0
        kept = []
        for c in self.chunks:
            d, r = c.due[c.pos :], c.refs[c.pos :]
            hit = np.isin(r, gone)
            hits = int(np.count_nonzero(hit))
            if hits:
                removed += hits
                if hits == len(d):
                    continue
                keep = ~hit
                c = _Chunk(d[keep], r[keep])
            kept.append(c)
        self.chunks = kept
        self.live -= removed
        return removed


def _stable_argsort(keys: np.ndarray, span: int, radix_min: int) -> np.ndarray:
    """Stable argsort of int64 keys in [0, span): 16-bit radix passes (O(n)) when they fit."""
    if len(keys) < radix_min or span > 1 << 32:
        return np.argsort(keys, kind="stable")
    if span <= 1 << 16:
        return np.argsort(keys.astype(np.uint16), kind="stable")  # numpy: radix sort
    order = np.argsort((keys & 0xFFFF).astype(np.uint16), kind="stable")
    high = (keys.take(order) >> 16).astype(np.uint16)
    return order.take(np.argsort(high, kind="stable"))


def _min_of(a: int | None, b: int | None) -> int | None:
    """Smaller of two optional ints."""
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


def _empty_due() -> np.ndarray:
    """A new empty due array."""
    return np.empty(0, dtype=np.int64)


def _empty_refs() -> np.ndarray:
    """A new empty refs array."""
    return np.empty(0, dtype=np.uint64)


def _as_int(name: str, value: object) -> int:
    """An integer argument as a Python int; TypeError for anything else (bool included)."""
    if isinstance(value, bool | np.bool_):
        raise TypeError(f"{name} must be an integer, got {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]  # a TypeError is what we want for non-ints
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None


def _int_array(name: str, value: object) -> np.ndarray:
    """A one-dimensional integer array; ValueError for another shape, TypeError for a dtype."""
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    return arr


def _refs(name: str, arr: np.ndarray) -> np.ndarray:
    """Integer refs as a new uint64 array; ValueError for negative values."""
    if arr.dtype.kind == "i" and len(arr) and int(arr.min()) < 0:
        raise ValueError(f"{name} must not be negative, found {int(arr.min())}")
    return arr.astype(np.uint64)


def _entries(due_ms: object, refs: object) -> tuple[np.ndarray, np.ndarray]:
    """Validate an add's arrays; return new int64 due and uint64 refs arrays the wheel owns."""
    due = _int_array("due_ms", due_ms)
    ref = _int_array("refs", refs)
    if len(due) != len(ref):
        raise ValueError(f"due_ms and refs differ in length: {len(due)} != {len(ref)}")
    if due.dtype == np.uint64 and len(due) and int(due.max()) > _INT64_MAX:
        raise ValueError(f"due_ms must fit in int64, found {int(due.max())}")
    return due.astype(np.int64), _refs("refs", ref)
