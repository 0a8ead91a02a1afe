"""Records already encoded (`storage.record.encode`'s bytes), with the columns the store files them by.

What a caller that writes record bytes itself (ingest's one pass over a pull answer) hands to
`ScheduleStore.append_encoded`: per row the record's bytes, its id, due time, body length and
business keys, and where it came from on the delay topic. Columns are plain lists: appending a
row costs no object beyond its own fields, and a batch is cut or joined by list slices.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from storage.record import Record

__all__ = ["EncodedRecords"]


@dataclass(slots=True)
class EncodedRecords:
    """Encoded records, one row each across the columns (all of one length)."""

    #: each record's bytes, exactly as `storage.record.encode` writes it
    blobs: list[bytes] = field(default_factory=list)
    msg_ids: list[str] = field(default_factory=list)
    due_ms: list[int] = field(default_factory=list)
    body_lengths: list[int] = field(default_factory=list)
    keys: list[tuple[str, ...]] = field(default_factory=list)
    #: the delay topic's queue each came from (`broker:queue id`; None: unknown) and its offset there
    queues: list[str | None] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.blobs)

    def append_row(self, blob: bytes, msg_id: str, due_ms: int, body_length: int, keys: tuple[str, ...],
                   queue: str | None, offset: int) -> None:
        """Add one row at the end."""
        self.blobs.append(blob)
        self.msg_ids.append(msg_id)
        self.due_ms.append(due_ms)
        self.body_lengths.append(body_length)
        self.keys.append(keys)
        self.queues.append(queue)
        self.offsets.append(offset)

    def extend(self, other: "EncodedRecords", start: int = 0, stop: int | None = None) -> None:
        """Add rows [start, stop) of `other` at the end."""
        for f in _COLUMNS:
            getattr(self, f).extend(getattr(other, f)[start:stop])

    def extend_unencoded(self, records: Sequence["Record"], origins: Sequence[tuple[str, int] | None] | None) -> None:
        """Add records not yet encoded: each `Record` stands in `blobs` where its bytes will (the store
        encodes only those it keeps: a duplicate never is); `origins` as `ScheduleStore.append` takes them."""
        self.blobs.extend(records)  # type: ignore[arg-type]
        self.msg_ids.extend([r.msg_id for r in records])
        self.due_ms.extend([r.due_ms for r in records])
        self.body_lengths.extend([len(r.body) for r in records])
        self.keys.extend([r.keys for r in records])
        ori = origins if origins is not None else [None] * len(records)
        self.queues.extend([o[0] if o is not None else None for o in ori])
        self.offsets.extend([o[1] if o is not None else 0 for o in ori])

    def take(self, rows: Sequence[int]) -> "EncodedRecords":
        """A new batch of the given rows, in that order."""
        out = EncodedRecords()
        for f in _COLUMNS:
            col = getattr(self, f)
            setattr(out, f, [col[i] for i in rows])
        return out

    def without(self, rows: Sequence[int]) -> "EncodedRecords":
        """A new batch without the given rows (the others in order)."""
        gone = set(rows)
        return self.take([i for i in range(len(self)) if i not in gone])


_COLUMNS = tuple(f.name for f in fields(EncodedRecords))
