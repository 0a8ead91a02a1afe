"""The record codec: one delayed message as bytes, with a CRC32C.

Layout (little-endian), written down for every reader in docs/FORMAT.md::

    offset size field
    0      1    magic       0xA7
    1      1    version     1
    2      2    flags       reserved, 0
    4      4    length      whole record in bytes, header included
    8      4    crc         CRC32C (Castagnoli) of bytes [12, length)
    12     8    due_ms      int64, UTC epoch ms the message is due
    20     8    enqueue_ms  int64, UTC epoch ms it was accepted
    28     2    id_len      bytes of the message id (UTF-8)
    30     2    topic_len   bytes of the target topic (UTF-8)
    32     2    tags_len    bytes of the tags (UTF-8, may be 0)
    34     2    keys_len    bytes of the encoded keys list
    36     4    props_len   bytes of the encoded properties
    40     4    body_len    bytes of the body
    44     ...  id, topic, tags, keys, properties, body, in that order

keys: repeated (uint16 length, UTF-8 bytes). properties: repeated (uint16 key length, key bytes,
uint16 value length, value bytes), UTF-8.

`check_record` is the one definition of a good record (`decode` applies it; `storage.record_reader`
applies it to many records at once, as columns).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import crc32c as _crc32c

from storage.errors import CorruptRecordError, InvalidRecordError

MAGIC = 0xA7
VERSION = 1
HEADER = struct.Struct("<BBHIIqqHHHHII")
HEADER_SIZE = HEADER.size
_CRC_FROM = struct.calcsize("<BBHII")  # CRC covers everything after the crc field
#: where the `length` field (uint32, little-endian) lies in a record's header
LENGTH_AT = struct.calcsize("<BBH")
_PREFIX = struct.Struct("<BBHI")  # magic, version, flags, length: enough to find the record's end
_U16 = struct.Struct("<H")
_PREFIX_CRC = struct.Struct("<BBHII")
_FIELDS = struct.Struct("<qqHHHHII")
# The limits, defined once and checked by both encode and decode (a record that encodes decodes).
MAX_FIELD = 0xFFFF  # id, topic, tags and the encoded keys: uint16 length fields
MAX_PROPERTIES = 64 * 1024 * 1024  # the encoded properties (a uint32 field, held to this)
MAX_BODY = 64 * 1024 * 1024
MAX_RECORD = HEADER_SIZE + 4 * MAX_FIELD + MAX_PROPERTIES + MAX_BODY
MIN_TIME, MAX_TIME = -(2**63), 2**63 - 1  # due_ms and enqueue_ms are int64

crc32c = _crc32c.crc32c


@dataclass(frozen=True, slots=True)
class Record:
    """One delayed message as stored: what is due, when, and where it goes."""

    msg_id: str
    topic: str
    body: bytes
    due_ms: int
    enqueue_ms: int = 0
    tags: str = ""
    keys: tuple[str, ...] = ()
    properties: Mapping[str, str] = field(default_factory=dict)


def encode_keys(keys: Sequence[str]) -> bytes:
    """The keys field of a record (repeated uint16 length, UTF-8 bytes); InvalidRecordError past `MAX_FIELD`."""
    if len(keys) == 1:
        b = keys[0].encode()
        if len(b) <= MAX_FIELD:
            return _U16.pack(len(b)) + b
    out = []
    for k in keys:
        b = k.encode()
        if len(b) > MAX_FIELD:
            raise InvalidRecordError(f"key of {len(b)} bytes exceeds {MAX_FIELD}")
        out.append(_U16.pack(len(b)))
        out.append(b)
    return b"".join(out)


def encode_properties(props: Mapping[str, str]) -> bytes:
    """The properties field of a record (repeated uint16 key length, key, uint16 value length,
    value), UTF-8; InvalidRecordError past `MAX_FIELD`."""
    out = []
    for k, v in props.items():
        kb = k.encode()
        vb = v.encode()
        if len(kb) > MAX_FIELD or len(vb) > MAX_FIELD:
            raise InvalidRecordError(f"property {k!r} exceeds {MAX_FIELD} bytes")
        out.append(_U16.pack(len(kb)))
        out.append(kb)
        out.append(_U16.pack(len(vb)))
        out.append(vb)
    return b"".join(out)


def encode(rec: Record, enqueue_ms: int | None = None) -> bytes:
    """Encode a record (with `enqueue_ms` instead of its own when given).

    Raises InvalidRecordError when a field does not fit the layout.
    """
    enqueue = rec.enqueue_ms if enqueue_ms is None else enqueue_ms
    if not (MIN_TIME <= rec.due_ms <= MAX_TIME and MIN_TIME <= enqueue <= MAX_TIME):
        raise InvalidRecordError(f"due time {rec.due_ms} or enqueue time {enqueue} of record {rec.msg_id!r} "
                                 "is outside int64 epoch milliseconds")
    try:
        idb = rec.msg_id.encode()
        tb = rec.topic.encode()
        tagb = rec.tags.encode() if rec.tags else b""
        kb = encode_keys(rec.keys) if rec.keys else b""
        pb = encode_properties(rec.properties) if rec.properties else b""
    except UnicodeEncodeError as e:
        raise InvalidRecordError(f"a text field of record {rec.msg_id!r} is not encodable as UTF-8: {e.reason}") from e
    body = rec.body
    li, lt, lg, lk, lp, lb = len(idb), len(tb), len(tagb), len(kb), len(pb), len(body)
    if not li or not lt:
        raise InvalidRecordError("a record needs a message id and a target topic")
    if li > MAX_FIELD or lt > MAX_FIELD or lg > MAX_FIELD or lk > MAX_FIELD:
        raise InvalidRecordError(f"id, topic, tags or keys of record {rec.msg_id!r} exceed {MAX_FIELD} bytes")
    if lb > MAX_BODY:
        raise InvalidRecordError(f"body of {lb} bytes exceeds the maximum of {MAX_BODY}")
    if lp > MAX_PROPERTIES:
        raise InvalidRecordError(f"properties of {lp} bytes exceed the maximum of {MAX_PROPERTIES}")
    return encode_fields(rec.due_ms, enqueue, idb, tb, tagb, kb, pb, body)


def encode_fields(due_ms: int, enqueue_ms: int, idb: bytes, tb: bytes, tagb: bytes, kb: bytes, pb: bytes,
                  body: bytes | memoryview) -> bytes:
    """A record from its fields already as bytes (keys by `encode_keys`, properties by
    `encode_properties`): what `encode` writes, without its checks; the caller keeps to the limits
    `encode` enforces (times in int64, id and topic non-empty, fields within `MAX_FIELD`,
    `MAX_PROPERTIES` and `MAX_BODY`)."""
    li, lt, lg, lk, lp, lb = len(idb), len(tb), len(tagb), len(kb), len(pb), len(body)
    tail = b"".join((_FIELDS.pack(due_ms, enqueue_ms, li, lt, lg, lk, lp, lb), idb, tb, tagb, kb, pb, body))
    return _PREFIX_CRC.pack(MAGIC, VERSION, 0, HEADER_SIZE + li + lt + lg + lk + lp + lb, crc32c(tail)) + tail


def record_length(buf: bytes | memoryview, offset: int = 0) -> int:
    """The total length a record at `offset` claims, after checking magic and version."""
    if len(buf) - offset < HEADER_SIZE:
        raise CorruptRecordError(f"{max(0, len(buf) - offset)} bytes left, a header needs {HEADER_SIZE}",
                                 offset=offset)
    magic, version, flags, length = _PREFIX.unpack_from(buf, offset)
    if magic != MAGIC:
        raise CorruptRecordError(f"magic 0x{magic:02x}, expected 0x{MAGIC:02x}", offset=offset)
    if version != VERSION:
        raise CorruptRecordError(f"version {version}, expected {VERSION}", offset=offset)
    if flags != 0:  # reserved: the CRC does not cover it, so it must hold its one known value
        raise CorruptRecordError(f"flags 0x{flags:04x}, expected 0", offset=offset)
    if length < HEADER_SIZE or length > MAX_RECORD:
        raise CorruptRecordError(f"length {length} outside [{HEADER_SIZE}, {MAX_RECORD}]", offset=offset)
    return length


def check_record(buf: bytes | memoryview, offset: int = 0, *, due_ms: int | None = None, length: int | None = None,
                 verify_crc: bool = True) -> tuple[int, ...]:
    """The header fields (`HEADER`) of the record at `offset` once it passes every check of the layout;
    raises CorruptRecordError saying the first that fails.

    The one definition of a good record, in this order: a whole header, magic, version, flags, length
    in range (and equal to the index's `length` when given), within `buf`, CRC32C (unless
    `verify_crc` is False), field lengths adding up, properties and body within the limits, keys and
    properties well formed, id, topic, tags, keys and properties UTF-8; last, the due time equal to
    the index's `due_ms` when given (the error then carries the record's own in `record_due_ms`).
    `storage.record_reader` checks many records at once to the same verdicts.
    """
    return _checked(buf, offset, due_ms, length, verify_crc, True)


def _checked(buf: bytes | memoryview, offset: int, due_ms: int | None, length: int | None, verify_crc: bool,
             fields: bool) -> tuple[int, ...]:
    """`_check` on a view of `buf`, released after; its error raised afresh."""
    mv = memoryview(buf)
    try:
        return _check(mv, offset, due_ms, length, verify_crc, fields)
    except CorruptRecordError as e:
        reason, record_due = e.reason, e.record_due_ms
    finally:
        mv.release()
    # a fresh error, and no name for it here: the caught one's traceback holds views of `buf`, and a
    # frame naming the raised one would hold it in a cycle, with its callers' frames (a map kept open)
    raise CorruptRecordError(reason, offset=offset, record_due_ms=record_due)


def _check(mv: memoryview, offset: int, due_ms: int | None, length: int | None, verify_crc: bool,
           fields: bool) -> tuple[int, ...]:
    """`check_record` on a view of the buffer (without `check_fields` and the due time unless `fields`)."""
    buf = mv
    size = record_length(buf, offset)
    if length is not None and size != length:
        raise CorruptRecordError(f"length {size}, index says {length}", offset=offset)
    end = offset + size
    if end > len(buf):
        raise CorruptRecordError(f"record of {size} bytes runs past the end ({len(buf) - offset} left)",
                                 offset=offset)
    h = HEADER.unpack_from(buf, offset)
    if verify_crc:
        found = crc32c(mv[offset + _CRC_FROM:end])
        if found != h[4]:
            raise CorruptRecordError(f"CRC32C 0x{found:08x}, header says 0x{h[4]:08x}", offset=offset)
    id_len, topic_len, tags_len, keys_len, props_len, body_len = h[7:]
    if HEADER_SIZE + id_len + topic_len + tags_len + keys_len + props_len + body_len != size:
        raise CorruptRecordError("field lengths do not add up to the record length", offset=offset)
    if props_len > MAX_PROPERTIES or body_len > MAX_BODY:
        raise CorruptRecordError(f"properties of {props_len} or body of {body_len} bytes past the limits "
                                 f"({MAX_PROPERTIES}, {MAX_BODY})", offset=offset)
    if fields:
        check_fields(mv, offset, id_len, topic_len, tags_len, keys_len, props_len)
        _check_due(h[5], due_ms, offset)
    return h


def _check_due(due: int, index_due: int | None, offset: int) -> None:
    """The last check: the record's own due time is the index's (when known)."""
    if index_due is not None and due != index_due:
        raise CorruptRecordError(f"due {due}, index says {index_due}", offset=offset, record_due_ms=due)


def check_fields(mv: memoryview, offset: int, id_len: int, topic_len: int, tags_len: int, keys_len: int,
                 props_len: int) -> None:
    """`check_record`'s check of the variable fields of a record at `offset` whose lengths add up:
    keys and properties well formed, every text UTF-8; raises CorruptRecordError."""
    p = offset + HEADER_SIZE
    texts = [mv[p:p + id_len], mv[p + id_len:p + id_len + topic_len]]
    p += id_len + topic_len
    if tags_len:
        texts.append(mv[p:p + tags_len])
    p += tags_len
    if keys_len:
        _walk(mv[p:p + keys_len], 1, texts, offset)
    p += keys_len
    if props_len:
        _walk(mv[p:p + props_len], 2, texts, offset)
    # one check for all: NUL between the fields, so that no sequence cut at one's end is completed by the next
    try:
        str(b"\x00".join(texts), "utf-8")
    except UnicodeDecodeError as e:
        raise CorruptRecordError(f"a text field is not UTF-8: {e.reason}", offset=offset) from None


def _walk(mv: memoryview, per_entry: int, out: list[memoryview], at: int) -> None:
    """Append the strings of a keys field (`per_entry` 1) or properties field (2: key, value) to `out`;
    raises CorruptRecordError, as the field decoders would, when one runs past the field."""
    p, n = 0, len(mv)
    words = (("truncated key length", "key runs past its field") if per_entry == 1 else
             ("truncated property key length", "property runs past its field", "property value runs past its field"))
    while p < n:
        if p + 2 > n:
            raise CorruptRecordError(words[0], offset=at)
        for k in range(per_entry):
            (ln,) = _U16.unpack_from(mv, p)
            p += 2
            # a property's key must leave room for its value's length
            if p + ln + (2 if k < per_entry - 1 else 0) > n:
                raise CorruptRecordError(words[1 + k], offset=at)
            out.append(mv[p:p + ln])
            p += ln


def decode(buf: bytes | memoryview, offset: int = 0, *, due_ms: int | None = None) -> tuple[Record, int]:
    """Decode the record at `offset`; returns it and its length. Raises CorruptRecordError
    (`check_record`, with the index's `due_ms` when given)."""
    (_m, _v, _f, length, _c, due, enqueue_ms, id_len, topic_len, tags_len, keys_len, props_len,
     body_len) = _checked(buf, offset, None, None, True, False)
    raw = bytes(buf[offset:offset + length])  # one copy; every field below is sliced from it
    p = HEADER_SIZE
    try:  # decoding the fields checks them as check_fields does (the same walk, strict UTF-8)
        msg_id = raw[p:p + id_len].decode(); p += id_len
        topic = raw[p:p + topic_len].decode(); p += topic_len
        tags = raw[p:p + tags_len].decode() if tags_len else ""; p += tags_len
        keys = decode_keys(memoryview(raw)[p:p + keys_len], offset) if keys_len else (); p += keys_len
        props = decode_properties(memoryview(raw)[p:p + props_len], offset) if props_len else {}
        p += props_len
        bad = False
    except (UnicodeDecodeError, CorruptRecordError):
        bad = True
    if bad:  # check_record's own words for it
        check_record(buf, offset)
        raise AssertionError(f"the record at offset {offset} does not decode, and check_record accepts it")
    _check_due(due, due_ms, offset)
    return Record(msg_id, topic, raw[p:p + body_len], due, enqueue_ms, tags, keys, props), length


def decode_keys(mv: memoryview, at: int) -> tuple[str, ...]:
    """The keys field (repeated uint16 length + UTF-8); `at` is the record's offset, for errors.

    Raises CorruptRecordError when a key runs past the field, UnicodeDecodeError on bad UTF-8.
    """
    keys = []
    p, n = 0, len(mv)
    while p < n:
        if p + 2 > n:
            raise CorruptRecordError("truncated key length", offset=at)
        (ln,) = _U16.unpack_from(mv, p)
        p += 2
        if p + ln > n:
            raise CorruptRecordError("key runs past its field", offset=at)
        keys.append(str(mv[p:p + ln], "utf-8"))
        p += ln
    return tuple(keys)


def decode_properties(mv: memoryview, at: int) -> dict[str, str]:
    """The properties field (repeated uint16 key length, key, uint16 value length, value), UTF-8;
    `at` is the record's offset, for errors.

    Raises CorruptRecordError when an entry runs past the field, UnicodeDecodeError on bad UTF-8.
    """
    props: dict[str, str] = {}
    p, n = 0, len(mv)
    while p < n:
        if p + 2 > n:
            raise CorruptRecordError("truncated property key length", offset=at)
        (kl,) = _U16.unpack_from(mv, p)
        p += 2
        if p + kl + 2 > n:
            raise CorruptRecordError("property runs past its field", offset=at)
        k = str(mv[p:p + kl], "utf-8")
        p += kl
        (vl,) = _U16.unpack_from(mv, p)
        p += 2
        if p + vl > n:
            raise CorruptRecordError("property value runs past its field", offset=at)
        props[k] = str(mv[p:p + vl], "utf-8")
        p += vl
    return props


def header_fields(buf: bytes | memoryview, offset: int = 0) -> tuple[int, int, int]:
    """(length, due_ms, crc_ok) of the record at offset, without decoding its fields."""
    length = record_length(buf, offset)
    if offset + length > len(buf):
        raise CorruptRecordError(f"record of {length} bytes runs past the end", offset=offset)
    crc = struct.unpack_from("<I", buf, offset + 8)[0]
    (due_ms,) = struct.unpack_from("<q", buf, offset + 12)
    return length, due_ms, int(crc32c(memoryview(buf)[offset + _CRC_FROM:offset + length]) == crc)
