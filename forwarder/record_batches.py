"""SEND_BATCH_MESSAGE bodies built from stored record bytes in one pass over the rows.

`cut_records` does, row by row and once, what `record_encoding.delivered_ids`,
`record_encoding.encode_records` and the producer's `cut_encoded` do in turn: per row it takes the
UNIQ_KEY (`codec.derived_id` of the stored id and due time), formats the properties once (the same
names, values and order as `encode_records`), and appends the message's head, a view of its stored
body and its properties to the open batch of its topic (cut within the count and byte limits as
`cut_encoded` cuts them). The request bodies that come out are byte for byte those of that general
path, which stays the reference (tests/forwarder/test_record_batches.py holds them equal).

A record's own properties (stored as length-prefixed pairs) go first, then `extra`, as the general
path's `to_outgoing` orders them. Rare rows take the general per-message encoder inside the pass:
own properties named as one the delivery sets (or repeated, or holding a separator), properties
over RocketMQ's limit, and, found by one search over all rows' text after the pass (the pass is
then run again, checking row by row), an id, tags or keys holding a separator. A batch of
a few rows reads its header columns as one Python tuple per row (a scalar path: the vectorised
column reads cost more than the rows themselves); a larger one reads each column once. Where it
was built (`pip install`), a compiled loop (`forwarder/_record_cut.pyx`) takes the plainest rows
and hands every other one to the pass here, row by row.
"""
from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Mapping

import numpy as np

from forwarder.contract import DUE_MS, ORIGINAL_MSG_ID, to_outgoing
from forwarder.record_encoding import _has_reserved, _joined_keys, _with  # the reference path's own helpers
from forwarder.rocketmq import EncodedBatches, MessageRejectedError, RemotingError, SendBatch
from forwarder.rocketmq.codec import MAX_PROPERTIES_BYTES, RESERVED_BYTES, derived_id, encode_message
from forwarder.rocketmq.message import KEYS, TAGS, UNIQ_KEY, WAIT
from forwarder.rocketmq.protocol import MESSAGE_ILLEGAL
from storage import RecordBytes
from storage.record_reader import HEADER_DTYPE
from timewheel.message import Message

_compiled_cut: Callable[..., int] | None
try:
    from forwarder._record_cut import cut as _compiled_cut
except ImportError:  # installed without a C compiler: every row takes the pass here
    _compiled_cut = None

__all__ = ["COMPILED", "cut_records"]

#: whether the compiled loop takes the plainest rows (else the pass here takes them all)
COMPILED = _compiled_cut is not None

#: rows up to this many read their header as tuples (one call) rather than column by column
SCALAR_ROWS = 32
#: one message of a batch body up to its body (`codec.encode_message`'s layout)
_HEAD = struct.Struct(">iiiii")
_PROPS_LEN = struct.Struct(">h")
_OVERHEAD = _HEAD.size + _PROPS_LEN.size
#: the properties' fixed parts (their names and separators), as `record_encoding` writes them
_ORIGINAL = f"{ORIGINAL_MSG_ID}\x01".encode()
_DUE = f"\x02{DUE_MS}\x01".encode()
_TAGS = f"\x02{TAGS}\x01".encode()
_KEYS = f"\x02{KEYS}\x01".encode()
#: the header fields a row needs, in `storage.RecordBytes.header`'s order of names
_COLUMNS = ("due_ms", "id_len", "topic_len", "tags_len", "keys_len", "props_len", "body_len")

_Row = tuple[int, int, int, int, int, int, int, int]  # start, due, then the lengths of _COLUMNS[1:]
#: where the compiled loop finds a row's due time and field lengths: the header's size, then offsets
_CUT_LAYOUT = (HEADER_DTYPE.itemsize, *(HEADER_DTYPE.fields[c][1] for c in _COLUMNS))  # type: ignore[index]


def cut_records(records: RecordBytes, fresh: Callable[[int], list[str]], extra: Mapping[str, str] | None = None,
                *, max_message: int, max_count: int, max_bytes: int) -> EncodedBatches:
    """Every row (every row good) encoded under its delivered id (one of `fresh(n)` for a row stored
    without an id) and cut into batches per topic; `extra` properties go on every message."""
    pairs = tuple(extra.items()) if extra else ()
    template, own_template, clash = _template(pairs), _own_template(pairs), _clash(pairs)
    n = len(records)
    missing = (records.header["id_len"].tolist().count(0) if n <= SCALAR_ROWS else
               int(np.count_nonzero(records.header["id_len"] == 0))) if n else 0
    ids = _Ids(fresh(missing) if missing else [])
    checked: list[bytes] = []
    limits = (max_message, max_count, max_bytes)
    templates = (template, own_template, clash)
    out = _pass(records, templates, extra, ids, checked, limits, _pieces(pairs))
    if checked and RESERVED_BYTES.search(b"".join(checked)):
        # rare: again, each row checked on its own, so that one holding a separator is refused in the
        # general path's words
        out = _pass(records, templates, extra, _Ids([], out.ids), None, limits, None)
    return out


@functools.lru_cache(maxsize=64)  # a replica's epoch, or nothing: the same few for every batch
def _pieces(extra: tuple[tuple[str, str], ...]) -> tuple[bytes, ...]:
    """What every message's properties hold around its own parts (`encode_records`' names and
    order): before the id and after the keys, for a record without properties of its own (the
    `extra` ones after the keys) and for one with them (its own, then `extra`, before the id);
    then the names of the due time, TAGS and KEYS. The templates and the compiled loop both use them."""
    if extra and RESERVED_BYTES.search("".join(f"{k}{v}" for k, v in extra).encode()):
        raise ValueError(f"extra properties {dict(extra)!r} hold a separator")
    wait_uniq = f"\x02{WAIT}\x01true\x02{UNIQ_KEY}\x01".encode()
    after = "".join(f"\x02{k}\x01{v}" for k, v in extra).encode() + wait_uniq
    before_own = "".join(f"{k}\x01{v}\x02" for k, v in extra).encode() + _ORIGINAL
    return _ORIGINAL, after, before_own, wait_uniq, _DUE, _TAGS, _KEYS


@functools.lru_cache(maxsize=64)
def _template(extra: tuple[tuple[str, str], ...]) -> bytes:
    """Every message's properties as one %-format: id, due time, TAGS (or nothing), KEYS (or nothing),
    the `extra` properties, WAIT, then UNIQ_KEY."""
    before, after = _pieces(extra)[:2]
    return before.replace(b"%", b"%%") + b"%s" + _DUE + b"%d%s%s" + after.replace(b"%", b"%%") + b"%s\x02"


@functools.lru_cache(maxsize=64)
def _own_template(extra: tuple[tuple[str, str], ...]) -> bytes:
    """`_template` for a record with properties of its own: those first (already serialised), then
    `extra`, the id, due time, TAGS, KEYS, WAIT and UNIQ_KEY (the general path's order)."""
    before, after = _pieces(extra)[2:4]
    return b"%s" + before.replace(b"%", b"%%") + b"%s" + _DUE + b"%d%s%s" + after.replace(b"%", b"%%") + b"%s\x02"


@functools.lru_cache(maxsize=64)
def _clash(extra: tuple[tuple[str, str], ...]) -> frozenset[bytes]:
    """Names a record's own property may not have on the one pass: the general path would set them over it."""
    return frozenset(n.encode() for n in (ORIGINAL_MSG_ID, DUE_MS, TAGS, KEYS, WAIT, UNIQ_KEY, *(k for k, _ in extra)))


def _own_properties(data: bytes, at: int, n: int, clash: frozenset[bytes]) -> bytes | None:
    """A record's properties field (uint16 little-endian lengths: `storage.record.encode_properties`)
    serialised as RocketMQ's (name \\x01 value \\x02, repeated); None when the general path must decide:
    a name in `clash` or repeated, or a separator in a name or value."""
    parts: list[bytes] = []
    names: set[bytes] = set()
    p, end = at, at + n
    while p < end:
        kl = data[p] | data[p + 1] << 8
        name = data[p + 2:p + 2 + kl]
        p += 2 + kl
        vl = data[p] | data[p + 1] << 8
        parts += (name, b"\x01", data[p + 2:p + 2 + vl], b"\x02")
        p += 2 + vl
        if name in clash or name in names:
            return None
        names.add(name)
    wire = b"".join(parts)
    count = len(names)
    if wire.count(1) != count or wire.count(2) != count or 0 in wire:
        return None
    return wire


class _Ids:
    """Each row's UNIQ_KEY: derived from its id and due time, the next fresh one, or as given."""

    __slots__ = ("fresh", "given")

    def __init__(self, fresh: list[str], given: list[str] | None = None) -> None:
        self.fresh = iter(fresh)
        self.given = given


def _rows(records: RecordBytes) -> list[_Row]:
    """Per row: where it starts, its due time and the lengths of its fields."""
    if len(records) <= SCALAR_ROWS:
        # HEADER_DTYPE: magic, version, flags, length, crc, due_ms, enqueue_ms, then the six lengths
        return [(s, h[5], *h[7:]) for s, h in zip(records.start.tolist(), records.header.tolist())]
    h = records.header
    return list(zip(records.start.tolist(), *(h[c].tolist() for c in _COLUMNS)))


def _pass(records: RecordBytes, templates: tuple[bytes, bytes, frozenset[bytes]],
          extra: Mapping[str, str] | None, row_ids: _Ids, checked: list[bytes] | None,
          limits: tuple[int, int, int], around: tuple[bytes, ...] | None) -> EncodedBatches:
    """The one pass. `checked` collects each row's text for one search afterwards; without it, each
    row is searched on its own and one holding a separator goes the general way. With `around`
    (`_pieces`), the compiled loop (where built) takes the plainest rows."""
    max_message, max_count, max_bytes = limits
    template, own_template, clash = templates
    data = records.data
    mv = memoryview(data)
    hsize = records.header.dtype.itemsize
    head_pack, plen_pack = _HEAD.pack, _PROPS_LEN.pack
    fresh, given = row_ids.fresh, row_ids.given
    ids: list[str] = [] if given is None else given
    keep = checked.append if checked is not None else None
    names: dict[bytes, str] = {}
    open_batch: dict[bytes, SendBatch] = {}
    batches: list[SendBatch] = []
    rejected: list[tuple[int, str, RemotingError]] = []
    compiled = (_compiled_cut if around is not None and given is None and len(records) > 1 and type(data) is bytes
                else None)
    if compiled is not None:
        start = np.ascontiguousarray(records.start, np.int64)
        header = np.ascontiguousarray(records.header).view(np.uint8).reshape(len(records), hsize)

        def new_batch(tkey: bytes) -> SendBatch:
            return SendBatch(_name(names, tkey))
    rows: list[_Row] | None = None
    i, n = 0, len(records)
    while i < n:
        if compiled is not None:
            i = compiled(data, start, header, _CUT_LAYOUT, i, derived_id, around, clash, MAX_PROPERTIES_BYTES,
                         max_message, max_count, max_bytes, open_batch, batches, new_batch, ids)
            if i >= n:
                break
        # one row the compiled loop left (or every row, without it)
        if rows is None:
            rows = _rows(records)
        s, due, il, tl, gl, kl, pl, bl = rows[i]
        row, i = i, i + 1
        a = s + hsize
        t = a + il
        mid = data[a:t]
        if given is None:
            uid = derived_id(mid, due) if il else next(fresh)
            ids.append(uid)
        else:
            uid = given[row]
        g = t + tl
        tkey = data[t:g]
        props: bytes | None = None
        # a record's own properties, serialised (b"": none; None: the general path decides)
        own = (_own_properties(data, g + gl + kl, pl, clash) if il else None) if pl else b""
        if own is not None and (keep is not None or not _has_reserved(records, row)):
            k = g + gl
            if kl:
                keys = data[k + 2:k + kl] if data[k] | data[k + 1] << 8 == kl - 2 else _joined_keys(data[k:k + kl])
            else:
                keys = b""
            if keep is not None:
                keep(data[a:k])  # id, topic and tags: one slice, as they lie in the record
                if keys:
                    keep(keys)
            tags, key_text = _TAGS + data[g:k] if gl else b"", _KEYS + keys if keys else b""
            props = (own_template % (own, mid, due, tags, key_text, uid.encode()) if pl
                     else template % (mid, due, tags, key_text, uid.encode()))
            if len(props) > MAX_PROPERTIES_BYTES:
                props = None  # the general path says why
        if props is None:
            try:
                whole = encode_message(to_outgoing(_with(Message.from_record(records.record(row)), extra)), uid)
            except MessageRejectedError as e:
                rejected.append((row, _name(names, tkey), e))
                continue
            size = len(whole)
            pieces: tuple[bytes | memoryview, ...] = (whole,)
        else:
            size = _OVERHEAD + bl + len(props)
            at = g + gl + kl + pl
            pieces = (head_pack(size, 0, 0, 0, bl), mv[at:at + bl], plen_pack(len(props)) + props)
        if size > max_message:
            rejected.append((row, _name(names, tkey), MessageRejectedError(
                f"message of {size} bytes exceeds the maximum of {max_message}", code=MESSAGE_ILLEGAL)))
            continue
        b = open_batch.get(tkey)
        if b is None or len(b.index) >= max_count or b.size + size > max_bytes:
            b = open_batch[tkey] = SendBatch(_name(names, tkey))
            batches.append(b)
        b.index.append(row)
        b.ids.append(uid)
        b.parts += pieces
        b.size += size
    return EncodedBatches(batches, rejected, ids)


def _name(names: dict[bytes, str], topic: bytes) -> str:
    """A topic's name from its stored bytes (each decoded once)."""
    name = names.get(topic)
    if name is None:
        name = names[topic] = topic.decode("utf-8", "replace")
    return name
