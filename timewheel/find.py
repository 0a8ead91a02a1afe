"""Where is my message: every stored message with an id or a business key, and its timeline.

One look-up for the command line (`timewheel find`, beside a running engine) and the admin API
(`GET /messages`, inside it). It reads only:

- the meta store: `i`+id gives a record's location (an id as a RocketMQ producer knows it, its
  UNIQ_KEY, names the engine ids made from it: `<UNIQ_KEY>:<crc>`), `k`+key gives the ids under a
  business key, `c`+id when an id was cancelled. Opened read-only beside the engine it misses
  what the engine stored since its last checkpoint, so `unflushed=True` also searches the ingest
  log's frames since then (at most `checkpoint_bytes`, 64 MiB by default);
- the record itself (CRC-checked): when it was stored, its due time, target topic, tags, keys, size
  (one the ingest log holds since the checkpoint is taken from there when its part does not hold
  it yet: a commit writes the log first, then the part);
- its segment's dispatch log (only the rows naming it, `storage.read_dispatch_entries_of`): every
  send attempt and outcome, with the broker's answer for a
  delivered message (its message id: what `mqadmin queryMsgById` takes) and the note of a failed
  one (the error, a dead letter's reason);
- the tombstone log: the cancels that name its id or one of its keys, and when they were sent.

Costs: by id, one meta get (plus a prefix seek), one record read and one dispatch-log read per
segment touched; by key, a prefix scan bounded by `limit`, then the same per message found.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from storage import (CANCELLED, CORRUPT, DEAD_LETTERED, DELIVERED, REPLAYED, RETRIED, TOMBSTONE_ID,
                     CorruptRecordError, MetaStore, MetaStoreCorruptError, Record, RecordReader, SegmentLayout,
                     SnapshotMovedError, StorageError, Tombstone, broker_message_id, decode, decode_tombstones,
                     read_dispatch_entries_of, records_holding, segment_name, tombstone_log)
from timewheel.cancels import producer_id

__all__ = ["DEFAULT_LIMIT", "MAX_LIMIT", "Found", "MessageFinder", "Step", "Trail"]

DEFAULT_LIMIT = 20
MAX_LIMIT = 1000  # messages one look-up answers at most (a key shared by millions stays cheap to ask about)
_LOOKS = 5  # views of the meta store one look-up beside a running engine tries while checkpoints move it on


@dataclass(frozen=True, slots=True)
class Step:
    """One step of a message's timeline: when (epoch ms; 0 if unknown), what, and its details."""

    at_ms: int
    what: str
    detail: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """As JSON-ready data."""
        return {"at_ms": self.at_ms, "what": self.what, **self.detail}


@dataclass(frozen=True, slots=True)
class Trail:
    """One stored message, where it lives, its state now and its timeline."""

    msg_id: str
    segment_ms: int
    part: int
    offset: int
    state: str  # delivered, cancelled, dead_lettered, corrupt, retrying, pending
    steps: tuple[Step, ...]
    record: Record | None  # None when the record could not be read (corrupt)

    def to_dict(self) -> dict[str, Any]:
        """As JSON-ready data."""
        rec = self.record
        out: dict[str, Any] = {"msg_id": self.msg_id, "state": self.state, "segment": segment_name(self.segment_ms),
                               "part": self.part, "offset": self.offset}
        if rec is not None:
            out.update(topic=rec.topic, tags=rec.tags, keys=list(rec.keys), due_ms=rec.due_ms,
                       stored_ms=rec.enqueue_ms, body_bytes=len(rec.body))
        out["steps"] = [s.to_dict() for s in self.steps]
        return out


@dataclass(frozen=True, slots=True)
class Found:
    """What one look-up found: the messages (at most its limit) and whether there were more."""

    query: dict[str, str]
    trails: list[Trail]
    truncated: bool
    #: when nothing is stored: the cancels that name what was asked (a message that arrives while its
    #: cancel is kept is cancelled on arrival, never stored: "not found" alone would read as lost)
    cancels: tuple[Step, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """As JSON-ready data."""
        return {"query": self.query, "count": len(self.trails), "truncated": self.truncated,
                "messages": [t.to_dict() for t in self.trails], "cancels": [c.to_dict() for c in self.cancels]}


class MessageFinder:
    """Finds stored messages by id or key in one data directory and tells each one's story."""

    def __init__(self, layout: SegmentLayout, meta: MetaStore, *, unflushed: bool = False) -> None:
        """Over `layout` and its `meta` store (the engine's own, or one opened read-only beside it,
        then with `unflushed` to search the ingest log for what the meta store does not show yet)."""
        self.layout = layout
        self.meta = meta
        self.unflushed = unflushed
        self._records = RecordReader(layout)
        self._owns_meta = False
        #: the store it opened was closed to look again from a fresh view, and that view is not open
        #: (its open failed): the next look-up opens it first, rather than read a closed store
        self._meta_closed = False

    @classmethod
    def beside_engine(cls, data_dir: str | Path) -> "MessageFinder":
        """A finder over a data directory that a running engine may be writing (reads only); a damaged
        meta store is `MetaStoreCorruptError`, as everywhere else."""
        layout = SegmentLayout.open_existing(data_dir)
        finder = cls(layout, _open_beside(layout), unflushed=True)
        finder._owns_meta = True
        return finder

    def close(self) -> None:
        """Release the record maps (and the meta store, if this finder opened it)."""
        self._records.close()
        if self._owns_meta and not self._meta_closed:
            self.meta.close()

    def __enter__(self) -> "MessageFinder":
        """Return self."""
        return self

    def __exit__(self, *exc: object) -> None:
        """Close."""
        self.close()

    # ---- the look-ups ---------------------------------------------------------------------------

    def by_id(self, msg_id: str, now_ms: int, limit: int = DEFAULT_LIMIT) -> Found:
        """Messages stored under `msg_id`: the engine's id, or the UNIQ_KEY its producer got back."""
        return self._again(lambda: self._by_id(msg_id, now_ms, _bounded(limit)))

    def by_key(self, key: str, now_ms: int, limit: int = DEFAULT_LIMIT) -> Found:
        """Messages stored under the business key `key` (RocketMQ keys)."""
        return self._again(lambda: self._by_key(key, now_ms, _bounded(limit)))

    # ---- how ------------------------------------------------------------------------------------

    def _again(self, look: Callable[[], Found]) -> Found:
        """`look`, from a fresh view of the meta store each time the engine beside it moved on
        during the look-up (its checkpoint flushed what this view showed only in the ingest log)."""
        for attempt in range(_LOOKS):
            if self._meta_closed:
                # an open that fails raises its own error here, and the flag stays: the next look-up tries again
                self.meta = _open_beside(self.layout)
                self._meta_closed = False
            try:
                return look()
            except SnapshotMovedError:
                if not self._owns_meta or attempt + 1 == _LOOKS:
                    raise
                self._meta_closed = True  # first: a close that fails leaves no view to read either
                self.meta.close()
        raise AssertionError("unreachable")

    def _by_id(self, msg_id: str, now_ms: int, limit: int) -> Found:
        ids = [msg_id] if self.meta.known([msg_id])[0] else []
        ids += [i for i in self.meta.ids_with_prefix(msg_id + ":", limit + 1)
                if i != msg_id and producer_id(i) == msg_id]  # not "A:B:…", another producer id, for "A"
        extra = self._unflushed(msg_id.encode(), lambda r: r.msg_id == msg_id or r.msg_id.startswith(msg_id + ":"))
        return self._found({"id": msg_id}, ids, extra, now_ms, limit)

    def _by_key(self, key: str, now_ms: int, limit: int) -> Found:
        ids = self.meta.ids_for_key(key, limit + 1)
        extra = self._unflushed(key.encode(), lambda r: key in r.keys)
        return self._found({"key": key}, ids, extra, now_ms, limit)

    def _unflushed(self, needle: bytes, matches: Any) -> dict[str, tuple[tuple[int, int, int], Record]]:
        """Records in the ingest log since the checkpoint that `matches` accepts, by id: each one's
        location and the record as the log holds it."""
        if not self.unflushed:
            return {}
        point = self.meta.get_document("checkpoint") or {"seq": 0, "pos": 0}
        out: dict[str, tuple[tuple[int, int, int], Record]] = {}
        for loc, raw in records_holding(self.layout.ingest_dir, int(point["seq"]), int(point["pos"]), [needle]):
            try:
                rec = decode(raw)[0]
            except CorruptRecordError:
                continue  # the frame's CRC held: bytes that only look like a record of ours
            if matches(rec):
                out[rec.msg_id] = ((int(loc["segment_ms"]), int(loc["part"]), int(loc["offset"])), rec)
        return out

    def _found(self, query: dict[str, str], ids: list[str], extra: dict[str, tuple[tuple[int, int, int], Record]],
               now_ms: int, limit: int) -> Found:
        where: dict[str, tuple[int, int, int]] = {}
        for mid, loc in zip(ids, self.meta.locations(ids)):
            if loc is not None:
                where[mid] = (loc.segment_ms, loc.part, loc.offset)
        for mid, (loc3, _) in sorted(extra.items(), key=lambda kv: kv[0]):
            where.setdefault(mid, loc3)
        # retention forgets a segment's ids before it removes the segment, but a view of the meta
        # store taken before that forget reaches the disk still names them: they are gone, not corrupt
        present = {seg: self.layout.segment_dir(seg).is_dir() for seg in {loc[0] for loc in where.values()}}
        chosen = sorted(((m, loc) for m, loc in where.items() if present[loc[0]]), key=lambda kv: (kv[1], kv[0]))
        truncated = len(chosen) > limit
        logged = {mid: rec for mid, (loc3, rec) in extra.items() if where[mid] == loc3}
        if not chosen:
            return Found(query, [], False, self._cancels_of(query))
        return Found(query, self._trails(chosen[:limit], now_ms, logged), truncated)

    def _cancels_of(self, query: dict[str, str]) -> tuple[Step, ...]:
        """The kept cancels that name the id (or a message id made from it) or the key asked about."""
        (how, text), = query.items()
        tombstones = self._tombstones({text})
        if how == "id":
            return tuple(_cancel_steps(text, None, tombstones))
        return tuple(Step(t.born_ms, "cancel_received", {"by": "key", "key": t.text, "kept_until_ms": t.expires_ms})
                     for t in tombstones if t.kind != TOMBSTONE_ID and t.text == text)

    def _trails(self, chosen: Sequence[tuple[str, tuple[int, int, int]]], now_ms: int,
                logged: dict[str, Record]) -> list[Trail]:
        if not chosen:
            return []
        segs = [loc[0] for _, loc in chosen]
        read = self._records.read(segs, [loc[1] for _, loc in chosen], [loc[2] for _, loc in chosen])
        # a commit under way has written the ingest log, not the part yet: the log's copy (CRC-checked,
        # what a replay would write there) is the record, not a corrupt one
        read = [r if isinstance(r, Record) else logged.get(mid, r) for (mid, _), r in zip(chosen, read)]
        logs = {}
        for seg in sorted(set(segs)):  # only the entries of the records asked about, however large the log
            mine = [loc for _, loc in chosen if loc[0] == seg]
            logs[seg] = read_dispatch_entries_of(self.layout.dispatch_log(seg), np.asarray([p for _, p, _ in mine]),
                                                 np.asarray([o for _, _, o in mine]))
        needles = {t for mid, _ in chosen for t in (mid, producer_id(mid))}
        needles.update(k for rec in read if isinstance(rec, Record) for k in rec.keys)
        tombstones = self._tombstones(needles)
        out = []
        for (mid, (seg, part, offset)), rec in zip(chosen, read):
            record = rec if isinstance(rec, Record) else None
            if record is None and not self.layout.segment_dir(seg).is_dir():
                continue  # retired while it was being read
            steps = _stored_step(mid, record, seg, part, offset, rec)
            steps += _cancel_steps(mid, record, tombstones)
            log = logs[seg]
            rows = np.flatnonzero((log.entries["part"] == part) & (log.entries["offset"] == offset))
            steps += [_dispatch_step(log, int(r), record) for r in rows.tolist()]
            outcomes = [int(log.entries["outcome"][r]) for r in rows.tolist()]
            cancelled_at = self.meta.cancelled_at(mid)
            if cancelled_at is not None and CANCELLED not in outcomes:
                steps.append(Step(cancelled_at, "cancelled", {"by": "the engine's cancel (meta store)"}))
                outcomes.append(CANCELLED)
            state = _state(outcomes, record is None)
            if state in ("pending", "retrying") and record is not None:
                steps.append(_pending_step(record, now_ms, state))
            first, rest = steps[0], sorted(steps[1:], key=lambda s: s.at_ms)
            out.append(Trail(mid, seg, part, offset, state, (first, *rest), record))
        return out

    def _tombstones(self, needles: set[str]) -> list[Tombstone]:
        """The tombstones, decoded only when the log holds one of the ids or keys asked about (a log
        of a million cancels is searched at memory speed, not decoded, when none names them)."""
        path = tombstone_log(self.layout.root)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return []
        if not any(n.encode() in data for n in needles if n):
            return []
        return decode_tombstones(data).tombstones


def _open_beside(layout: SegmentLayout) -> MetaStore:
    """The meta store of `layout`, read-only, beside an engine that may be writing it."""
    try:
        return MetaStore(layout.meta_dir, read_only=True)
    except MetaStoreCorruptError:
        raise  # its own words name the file and say what to do, as `serve` and `inspect --verify` say them
    except StorageError as e:
        raise StorageError(f"cannot read the meta store of {layout.root}: {e}") from e


def _bounded(limit: int) -> int:
    if limit < 1:
        raise ValueError(f"limit = {limit}: ask for at least one message")
    return min(limit, MAX_LIMIT)


def _stored_step(mid: str, record: Record | None, seg: int, part: int, offset: int,
                 read: Record | CorruptRecordError) -> list[Step]:
    where = {"segment": segment_name(seg), "part": part, "offset": offset}
    if record is None:
        return [Step(0, "unreadable", {**where, "error": str(read)})]
    return [Step(record.enqueue_ms, "stored", {**where, "due_ms": record.due_ms, "topic": record.topic,
                                               "tags": record.tags, "keys": list(record.keys),
                                               "body_bytes": len(record.body)})]


def _cancel_steps(mid: str, record: Record | None, tombstones: list[Tombstone]) -> list[Step]:
    uniq = producer_id(mid)
    keys = set(record.keys) if record is not None else set()
    out = []
    for t in tombstones:
        if t.kind == TOMBSTONE_ID and t.text in (mid, uniq):
            out.append(Step(t.born_ms, "cancel_received", {"by": "id", "id": t.text, "kept_until_ms": t.expires_ms}))
        elif t.kind != TOMBSTONE_ID and t.text in keys:
            out.append(Step(t.born_ms, "cancel_received", {"by": "key", "key": t.text, "kept_until_ms": t.expires_ms}))
    return out


def _dispatch_step(log: Any, row: int, record: Record | None) -> Step:
    e = log.entries[row]
    outcome, attempts, at = int(e["outcome"]), int(e["attempts"]), int(e["dispatch_ms"])
    note_at = int(log.note[row])
    note = log.notes[note_at] if note_at >= 0 else None
    if outcome == DELIVERED and attempts == 0:
        return Step(at, "delivered_by_lease_holder",
                    {"note": "recorded on this standby replica: the shard's lease holder delivered it"})
    if outcome in (DELIVERED, REPLAYED):
        detail: dict[str, Any] = {"attempt": attempts}
        if record is not None:
            detail["topic"] = record.topic
        answer = log.answers[row]
        if int(answer["queue_offset"]) >= 0:
            detail.update(broker_msg_id=broker_message_id(answer), queue_id=int(answer["queue_id"]),
                          queue_offset=int(answer["queue_offset"]))
        return Step(at, "delivered" if outcome == DELIVERED else "replayed", detail)
    if outcome == RETRIED:
        return Step(at, "send_failed", {"attempt": attempts, "error": note, "then": "retried after a backoff"})
    if outcome == DEAD_LETTERED:
        return Step(at, "dead_lettered", {"attempts": attempts, "reason": note})
    if outcome == CANCELLED:
        return Step(at, "cancelled", {})
    if outcome == CORRUPT:
        return Step(at, "found_corrupt", {"note": "never served"})
    return Step(at, f"outcome_{outcome}", {})


#: a message's state when its dispatch log holds several terminal outcomes (a standby's cancel read
#: late beside the lease holder's delivery, a cancel written again): what went out comes first
_STATE_ORDER = ((DELIVERED, "delivered"), (DEAD_LETTERED, "dead_lettered"), (CANCELLED, "cancelled"),
                (CORRUPT, "corrupt"))


def _state(outcomes: list[int], unreadable: bool) -> str:
    for outcome, state in _STATE_ORDER:
        if outcome in outcomes:
            return state
    if unreadable:
        return "corrupt"
    return "retrying" if RETRIED in outcomes else "pending"


def _pending_step(record: Record, now_ms: int, state: str) -> Step:
    if state == "retrying":
        why = "a send failed; it waits in the retry queue for its next attempt"
    elif record.due_ms > now_ms:
        why = f"waits for its due time, in {_span(record.due_ms - now_ms)}"
    else:
        why = (f"due {_span(now_ms - record.due_ms)} ago and not sent yet: is the engine running and caught "
               "up (`timewheel status`), or is traffic shaping holding its topic back?")
    return Step(now_ms, "pending", {"due_ms": record.due_ms, "note": why})


def _span(ms: int) -> str:
    s = ms / 1000
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= size:
            return f"{s / size:.1f} {unit}"
    return f"{s:.1f} s"
