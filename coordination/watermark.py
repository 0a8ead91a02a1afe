"""A shard's delivered-up-to watermark as a znode: written by the lease holder, read by the others.

The znode `<shard>/watermark` holds JSON: `{"epoch": E, "watermark_ms": W, "replica": R,
"published_ms": T, "offsets": {"<broker>:<queue id>": O, ...}}`. Every message of the shard due at
or before W **whose offset in its queue is below that queue's O** was delivered (or otherwise
finished) by replica R while it held the lease with epoch E: R had stored everything of the queue
below O before it computed W. A message that reached the shard after W passed its due time has an
offset at or past O, and is not covered. A document without `offsets` (written before they existed)
covers by W alone. `"exceptions": [["<broker>:<queue id>", O, due], ...]` (absent: none) lists the
holder's entries due by W that it had not finished when it published (a message being retried): W
passes them, and they are not covered, nor is any entry due at a listed due time (another copy of
a listed message, stored by this replica from another queue, has another origin). A write is a
compare-and-set on the znode's version, and refused when the stored epoch is newer: a holder that
lost its lease cannot move the watermark of its successor.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError

from storage import LOST_QUEUE
from timewheel.gate import NO_WATERMARK, DeliveredMark

__all__ = ["MAX_EXCEPTIONS", "MalformedWatermark", "Watermark", "covered_by", "engine_mark", "publish_watermark",
           "read_watermark"]

#: at most this many exceptions travel with a mark; past them, W stops before the next one
MAX_EXCEPTIONS = 64


class MalformedWatermark(ValueError):
    """The watermark znode holds something that is not a watermark."""


@dataclass(frozen=True)
class Watermark:
    """What the last holder published (epoch 0 and NO_WATERMARK: nothing yet)."""

    epoch: int = 0
    watermark_ms: int = NO_WATERMARK
    replica: str = ""
    published_ms: int = 0
    #: per queue, the offset below which the holder had stored everything (None: a document from
    #: before offsets were published, which covers by the watermark alone)
    offsets: Mapping[str, int] | None = field(default=None, compare=False)
    #: (queue, offset, due ms) of the holder's entries due by the watermark but not yet finished: not covered
    exceptions: tuple[tuple[str, int, int], ...] = field(default=(), compare=False)

    def to_json(self) -> bytes:
        """The znode's data."""
        doc: dict[str, object] = {"epoch": self.epoch, "watermark_ms": self.watermark_ms, "replica": self.replica,
                                  "published_ms": self.published_ms}
        if self.offsets is not None:
            doc["offsets"] = dict(self.offsets)
        if self.exceptions:
            doc["exceptions"] = [list(e) for e in self.exceptions]
        return json.dumps(doc).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "Watermark":
        """Parse the znode's data (empty: nothing published); MalformedWatermark says what is wrong."""
        if not data:
            return cls()
        try:
            doc = json.loads(data)
            offsets = doc.get("offsets")
            if offsets is not None:
                offsets = {str(k): int(v) for k, v in dict(offsets).items()}
            exceptions = tuple((str(q), int(o), int(d)) for q, o, d in doc.get("exceptions") or ())
            return cls(int(doc["epoch"]), int(doc["watermark_ms"]), str(doc["replica"]), int(doc["published_ms"]),
                       offsets, exceptions)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise MalformedWatermark(f"the watermark znode holds {bytes(data[:200])!r}, not a watermark: {e}; "
                                     "nothing but the lease holder may write it") from e


def read_watermark(client: KazooClient, shard_path: str) -> Watermark:
    """The shard's watermark (the empty one when none was published)."""
    try:
        data, _ = client.get(f"{shard_path}/watermark")
    except NoNodeError:
        return Watermark()
    return Watermark.from_json(data)


def publish_watermark(client: KazooClient, shard_path: str, mark: Watermark) -> bool:
    """Write `mark` unless a newer epoch wrote already; never moves it back within an epoch.

    Returns False when a newer epoch owns the watermark (the caller lost its lease).
    """
    path = f"{shard_path}/watermark"
    for _ in range(5):
        try:
            data, stat = client.get(path)
        except NoNodeError:
            try:
                client.create(path, mark.to_json(), makepath=True)
                return True
            except NodeExistsError:
                continue
        try:
            old = Watermark.from_json(data)
        except MalformedWatermark:
            old = Watermark()  # the holder (only it writes here) replaces what it cannot read
        if old.epoch > mark.epoch:
            return False
        if old.epoch == mark.epoch and (old.watermark_ms > mark.watermark_ms or (
                old.watermark_ms == mark.watermark_ms and old.exceptions == mark.exceptions
                and old.offsets == mark.offsets)):
            return True  # never back; at the same W, written again only when it covers differently
        try:
            client.set(path, mark.to_json(), version=stat.version)
            return True
        except BadVersionError:
            continue
    return False


def engine_mark(epoch: int, replica: str, now_ms: Callable[[], int], delivered: Callable[[], int | DeliveredMark],
                offsets: Callable[[], dict[str, int]] | None) -> Watermark | None:
    """The holder's engine's watermark and stored offsets under `epoch`; None when its mark is frozen.

    The offsets are read first: every message below them was in the engine when the watermark
    was computed, so the watermark speaks for each of them. The watermark is never ahead of the
    holder's own clock (`now_ms`, read between the two).
    """
    stored = offsets() if offsets is not None else None
    now = now_ms()
    got = delivered()
    done = got if isinstance(got, DeliveredMark) else DeliveredMark(got)
    if done.frozen:
        # the engine failed on its delivery path and stops: the mark already published stays,
        # with the offsets it was computed for (with newer ones it could cover unsent messages)
        return None
    w = min(done.up_to, now)
    return Watermark(epoch, w, replica, now, stored, tuple(e for e in done.exceptions[:MAX_EXCEPTIONS] if e[2] <= w))


def covered_by(marks: Sequence[Watermark], due: np.ndarray, origins: np.ndarray, queue_names: Sequence[str],
               now_ms: int) -> np.ndarray:
    """Which entries one of `marks` covers (a bool each): due at or before its watermark and this
    replica's clock, and below its offset for the entry's queue. `origins` are `storage.ORIGIN_DTYPE`
    rows numbered by `queue_names`; an entry with no known origin, or a mark without offsets, is
    judged by the watermark alone. An entry a mark lists among its exceptions (by origin, or due at
    a listed due time: another copy of the listed message) is not covered by it, nor is one whose
    origin row was lost (`storage.LOST_QUEUE`: it may have reached the holder after its watermark)."""
    out = np.zeros(len(due), bool)
    queue = origins["queue"].astype(np.int64)
    lost = queue == LOST_QUEUE
    unknown = queue < 0
    for mark in marks:
        covered = due <= min(mark.watermark_ms, now_ms)
        if mark.exceptions:
            covered &= ~_listed(mark.exceptions, due, origins, queue_names)
        if mark.offsets is None:
            out |= covered
            continue
        limits = np.array([mark.offsets.get(name, -1) for name in queue_names] + [-1], np.int64)
        below = origins["offset"] < limits[np.where(unknown, len(queue_names), queue)]
        out |= covered & (unknown | below)
    return out & ~lost


def _listed(exceptions: Sequence[tuple[str, int, int]], due: np.ndarray, origins: np.ndarray,
            queue_names: Sequence[str]) -> np.ndarray:
    """Which entries a mark's exceptions may name: by origin, or by due time.

    A message can lie on the delay topic twice (a producer's retry to another queue): each replica
    stores the copy it read first and drops the other as a repeated id, so the holder's listed copy
    may have another origin than this replica's. Both copies have the listed due time (the id is
    made from it), so an entry due then is taken for it: held, never recorded as delivered.
    """
    number = {name: i for i, name in enumerate(queue_names)}
    out = np.isin(due, np.array([d for _, _, d in exceptions], np.int64))
    for queue, offset, _ in exceptions:
        q = number.get(queue)
        if q is not None:
            out |= (origins["queue"] == q) & (origins["offset"] == offset)
    return out
