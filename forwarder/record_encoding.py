"""The delivered message of each stored record, encoded for a batch body straight from its bytes:
the general path, kept as the reference of `record_batches.cut_records` (which the sink uses).

`encode_records` gives, per row of a `storage.RecordBytes`, exactly the bytes that
`codec.encode_message(contract.to_outgoing(message), msg_id)` gives for the message the record
holds, without building the `Message`, the `OutgoingMessage` or a properties dict: the
properties are concatenated from slices of the stored record (its id, tags, keys) and the due
time, in the same order (TW_ORIGINAL_MSG_ID, TW_DUE_MS, TAGS, KEYS, WAIT, UNIQ_KEY). A record
carrying properties of its own (a minority: the stored properties are length-prefixed, RocketMQ's
are separator-delimited, and theirs come first and may repeat a name), or an id, tags or keys
holding a separator (refused with the error the general path gives), takes the general path.

`delivered_ids` gives each row's UNIQ_KEY (`contract.delivered_id` of its id and due time), read
from the same slices.
"""
from __future__ import annotations

import struct
from collections.abc import Callable, Mapping
from dataclasses import replace

from forwarder.contract import DUE_MS, ORIGINAL_MSG_ID, to_outgoing
from forwarder.rocketmq.codec import MAX_PROPERTIES_BYTES, RESERVED_BYTES, derived_id, encode_message, encode_serialized
from forwarder.rocketmq.errors import MessageRejectedError
from forwarder.rocketmq.message import KEYS, TAGS, UNIQ_KEY, WAIT
from storage import RecordBytes
from timewheel.message import Message

__all__ = ["delivered_ids", "encode_records"]

_ORIGINAL = f"{ORIGINAL_MSG_ID}\x01".encode()
_DUE = f"\x02{DUE_MS}\x01".encode()
_TAGS = f"\x02{TAGS}\x01".encode()
_KEYS = f"\x02{KEYS}\x01".encode()
_TAIL = f"\x02{WAIT}\x01true\x02{UNIQ_KEY}\x01".encode()
_END = b"\x02"
_U16 = struct.Struct("<H")


def encode_records(records: RecordBytes, ids: list[str],
                   extra: Mapping[str, str] | None = None) -> list[bytes | MessageRejectedError]:
    """Per row (every row good), its message for a batch body under `ids[i]`, or why it cannot go;
    `extra` properties go on every message (a replica's lease epoch)."""
    tail = _TAIL
    if extra:
        if RESERVED_BYTES.search("".join(f"{k}{v}" for k, v in extra.items()).encode()):
            raise ValueError(f"extra properties {dict(extra)!r} hold a separator")
        tail = "".join(f"\x02{k}\x01{v}" for k, v in extra.items()).encode() + _TAIL
    id_at, _, tags_at, keys_at, _, body_at = (a.tolist() for a in records.field_starts())
    h = records.header
    id_len, tags_len, keys_len = h["id_len"].tolist(), h["tags_len"].tolist(), h["keys_len"].tolist()
    props_len, body_len, due = h["props_len"].tolist(), h["body_len"].tolist(), h["due_ms"].tolist()
    data, mv = records.data, memoryview(records.data)
    out: list[bytes | MessageRejectedError] = []
    general: list[int] = []
    checked: list[bytes] = []  # every id, tags and keys taken as they are: one search for separators
    for i in range(len(ids)):
        if props_len[i]:
            out.append(b"")
            general.append(i)
            continue
        a = id_at[i]
        mid = data[a:a + id_len[i]]
        parts = [_ORIGINAL, mid, _DUE, str(due[i]).encode()]
        checked.append(mid)
        if tags_len[i]:
            a = tags_at[i]
            tags = data[a:a + tags_len[i]]
            parts += (_TAGS, tags)
            checked.append(tags)
        if keys_len[i]:
            a = keys_at[i]
            n = keys_len[i]
            keys = data[a + 2:a + n] if _U16.unpack_from(data, a)[0] == n - 2 else _joined_keys(data[a:a + n])
            if keys:
                parts += (_KEYS, keys)
                checked.append(keys)
        parts += (tail, ids[i].encode(), _END)
        props = b"".join(parts)
        if len(props) > MAX_PROPERTIES_BYTES:
            out.append(b"")
            general.append(i)
            continue
        a = body_at[i]
        out.append(encode_serialized(mv[a:a + body_len[i]], props))
    if checked and RESERVED_BYTES.search(b"".join(checked)):
        # rare: find the rows, and let the general path refuse them with its own words
        general += [i for i, d in enumerate(out) if d and _has_reserved(records, i)]
    for i in general:
        try:
            out[i] = encode_message(to_outgoing(_with(Message.from_record(records.record(i)), extra)), ids[i])
        except MessageRejectedError as e:
            out[i] = e
    return out


def delivered_ids(records: RecordBytes, fresh: Callable[[int], list[str]]) -> list[str]:
    """Per row, the UNIQ_KEY its delivered copy carries: `contract.delivered_id(msg_id, due_ms)`, or
    one of `fresh(n)` for a row stored without an id (nothing to derive one from)."""
    id_at = records.field_starts()[0].tolist()
    h = records.header
    id_len, due = h["id_len"].tolist(), h["due_ms"].tolist()
    data = records.data
    # derived_id of the id's bytes is contract.delivered_id of the id: ids are stored as UTF-8
    out = [derived_id(data[a:a + n], d) if n else "" for a, n, d in zip(id_at, id_len, due)]
    if not all(out):
        spare = iter(fresh(out.count("")))
        out = [i or next(spare) for i in out]
    return out


def _with(m: Message, extra: Mapping[str, str] | None) -> Message:
    """The message with `extra` properties added."""
    return replace(m, properties={**(m.properties or {}), **extra}) if extra else m


def _joined_keys(field: bytes) -> bytes:
    """Several stored keys (uint16 length + bytes, repeated) as RocketMQ's KEYS: space-separated."""
    keys, p = [], 0
    while p < len(field):
        (n,) = _U16.unpack_from(field, p)
        keys.append(field[p + 2:p + 2 + n])
        p += 2 + n
    return b" ".join(keys)


def _has_reserved(records: RecordBytes, i: int) -> bool:
    """Whether row i's id, tags or keys hold a separator."""
    rec = records.record(i)
    return RESERVED_BYTES.search(" ".join((rec.msg_id, rec.tags, *rec.keys)).encode()) is not None
