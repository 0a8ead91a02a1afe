"""Ingest in one pass: a pull answer's body walked once, each common delay message straight to the
record bytes the store writes for it, with the columns the store and the meta store file it by.

A message takes this path when nothing about it is unusual: stored as sent (not compressed), its
framing within its size, topic and properties UTF-8 without U+FFFD or NUL, properties well formed
(a repeated name read as `split_properties` reads it), no cancel, a valid target, a due time in plain ASCII digits within the maximum delay,
a body within the limits, and properties that fit as delivered. For such a message the contract
(`forwarder.contract.to_message`), the engine's checks and `storage.record.encode` agree with what
is done here, byte for byte (tests/forwarder/test_ingest_pass.py checks it under hypothesis). Every
other message is decoded as before (`codec.decode_messages`, one message at a time) and handed on
as a `ReceivedMessage` to the general path, which decides what becomes of it (a cancel, a dead
letter, a message) exactly as it always did. A fault in the framing sends the whole answer there.

The stored-message layout is the codec's (`forwarder.rocketmq.codec`, its one definition); this
module reads it with the codec's own structs. Where it was built (`pip install`), a compiled loop
(`forwarder/_ingest_walk.pyx`) takes the plainest messages (ASCII text, no repeated property of
their own, a target already checked) and hands every other one to the walk here, message by message.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from operator import methodcaller
from typing import Callable

import crc32c

from forwarder.contract import (DEAD_LETTER_MAX_BODY, DELAY_MS, DELIVER_AT_MS, DELIVERY_PROPERTIES_BUDGET, DUE_MS,
                                ORIGINAL_MSG_ID, START_DELIVER_TIME, TARGET_TOPIC, ContractLimits, ContractViolation,
                                CONTRACT_PROPERTIES, check_target_topic, delay_base)
from forwarder.control import CONTROL_PROPERTIES
from forwarder.rocketmq.codec import _I16, _I32, _I64, _MAGIC_V1, _MAGIC_V2, _STORED_HEAD, decode_messages
from forwarder.rocketmq.compression import COMPRESSED, InflateBudget
from forwarder.rocketmq.errors import MessageDecodeError
from forwarder.rocketmq.message import (KEYS, NAME_VALUE_SEPARATOR, PROPERTY_SEPARATOR, SYSTEM_PROPERTIES, TAGS,
                                        UNIQ_KEY, ReceivedMessage, join_properties)
from storage import MAX_FIELD, EncodedRecords, encode_fields, encode_keys, encode_properties

_compiled_walk: Callable[..., tuple[int, int, int]] | None
try:
    from forwarder._ingest_walk import walk as _compiled_walk
except ImportError:  # installed without a C compiler: every message takes the walk here
    _compiled_walk = None

__all__ = ["COMPILED", "OnePass", "PulledAnswer"]

#: whether the compiled loop takes the plainest messages (else the walk here takes them all)
COMPILED = _compiled_walk is not None

#: names that never pass through to the delivered message (RocketMQ's and the contract's own)
_NOT_CARRIED = SYSTEM_PROPERTIES | CONTRACT_PROPERTIES
_TRANSIENT_PREFIX = "__RMQ.TRANSIENT."
_SPLIT_PAIR = methodcaller("split", NAME_VALUE_SEPARATOR, 1)
_UNIQ_KEY_PAIR = UNIQ_KEY + NAME_VALUE_SEPARATOR
_HEAD_SIZE = _STORED_HEAD.size
_BORNHOST_V6, _STOREHOST_V6 = 0x10, 0x20
#: what delivery adds to a message's own properties, less the id's and the due time's digits
_DELIVERY_ADDS = len(ORIGINAL_MSG_ID) + len(DUE_MS) + 4
#: at most this many digits: always within int64, as the contract's parse requires
_MAX_DIGITS = 18
#: target topics checked so far (names seen are few; forgotten when past this many)
_MAX_TARGETS = 4096
#: what each property name is to the compiled loop (its roles: forwarder/_ingest_walk.pyx); a name
#: not here is carried to the delivered message (unless transient)
_ROLES: dict[bytes, int] = {**{n.encode(): 8 for n in _NOT_CARRIED},
                            **{n.encode(): r for n, r in ((TARGET_TOPIC, 1), (DELIVER_AT_MS, 2), (DELAY_MS, 3),
                                                          (START_DELIVER_TIME, 4), (UNIQ_KEY, 5), (TAGS, 6), (KEYS, 7))},
                            **{n.encode(): 9 for n in CONTROL_PROPERTIES}}
#: the framing and limits the compiled loop keeps to, in its order
_WALK_LIMITS = (_HEAD_SIZE, _MAGIC_V1, _MAGIC_V2, COMPRESSED, _BORNHOST_V6, _STOREHOST_V6, _MAX_DIGITS,
                DELIVERY_PROPERTIES_BUDGET - _DELIVERY_ADDS, MAX_FIELD)
assert _TRANSIENT_PREFIX == "__RMQ.TRANSIENT."  # the compiled loop's own copy of it


@dataclass(slots=True)
class PulledAnswer:
    """One pull answer's messages: the common ones as encoded records, the others as
    `ReceivedMessage`s, with the order among them (what the pull consumer hands to ingest)."""

    body: bytes
    broker: str
    max_body_bytes: int
    #: the common messages, as records (accepted at `now_ms`)
    rows: EncodedRecords = field(default_factory=EncodedRecords)
    #: where each row's message starts in `body`
    at: list[int] = field(default_factory=list)
    #: the other messages, in order, and each one's position among all of the answer's messages
    general: list[ReceivedMessage] = field(default_factory=list)
    general_at: list[int] = field(default_factory=list)
    count: int = 0
    last: int = -1  # the queue offset of the last message
    now_ms: int = 0

    def __len__(self) -> int:
        return self.count

    def unreadable(self) -> list[str]:
        """Why each message that cannot be read cannot (they are all general)."""
        return [m.undecodable for m in self.general if m.undecodable]

    def last_offset(self) -> int:
        """The queue offset of the answer's last message."""
        return self.last

    def received(self, row: int) -> ReceivedMessage:
        """Row `row` decoded as the general path decodes it (to dead-letter it)."""
        p = self.at[row]
        (total,) = _I32.unpack_from(self.body, p)
        [msg] = decode_messages(self.body[p:p + total], self.max_body_bytes, self.broker)
        return msg

    @classmethod
    def of_messages(cls, messages: list[ReceivedMessage], broker: str = "", max_body_bytes: int = 0) -> "PulledAnswer":
        """An answer of general messages only (decoded elsewhere)."""
        last = messages[-1].queue_offset if messages else -1
        return cls(b"", broker, max_body_bytes, general=list(messages), general_at=list(range(len(messages))),
                   count=len(messages), last=last)


class OnePass:
    """Reads pull answers' bodies in one pass under one engine's contract (`limits`, the clock)."""

    def __init__(self, limits: ContractLimits, now_ms: Callable[[], int], *, compiled: bool = True) -> None:
        """Check what is read against `limits`; records are accepted at `now_ms()` of each answer
        (`compiled` False: without the compiled loop, where it was built)."""
        self.limits = limits
        self.now_ms = now_ms
        self._max_body = min(limits.max_body_bytes, DEAD_LETTER_MAX_BODY)
        self._targets: dict[str, bytes] = {}
        self._target_bytes: dict[bytes, bytes] = {}  # the same, by their bytes (for the compiled loop)
        self._compiled = _compiled_walk if compiled else None

    def _target(self, name: str) -> bytes | None:
        """The target topic's bytes when it may be delivered to, else None (the general path says why)."""
        try:
            check_target_topic(name, self.limits.reserved_topics)
        except ContractViolation:
            return None
        if len(self._targets) >= _MAX_TARGETS:
            self._targets.clear()
            self._target_bytes.clear()
        b = self._targets[name] = name.encode()
        self._target_bytes[b] = b
        return b

    def read(self, body: bytes, max_body_bytes: int, broker: str, budget: InflateBudget | None = None) -> PulledAnswer:
        """A pull answer's body as a `PulledAnswer`; a framing fault raises MessageDecodeError as
        `codec.decode_messages` does (with the budget as it was before this answer)."""
        now = self.now_ms()
        out = PulledAnswer(body, broker, max_body_bytes, now_ms=now)
        undo = (budget.remaining, budget.taken) if budget is not None else (0, 0)
        try:
            self._walk(out, body, budget, now)
        except MessageDecodeError:
            if budget is not None:
                budget.remaining, budget.taken, budget.stopped = undo[0], undo[1], False
            return PulledAnswer.of_messages(decode_messages(body, max_body_bytes, broker, budget), broker,
                                            max_body_bytes)
        return out

    def _walk(self, out: PulledAnswer, body: bytes, budget: InflateBudget | None, now: int) -> None:
        mv = memoryview(body)
        n = len(body)
        rows, at, general, general_at = out.rows, out.at, out.general, out.general_at
        blobs, ids, dues, lengths, key_col, queues, offsets = (rows.blobs, rows.msg_ids, rows.due_ms,
                                                               rows.body_lengths, rows.keys, rows.queues, rows.offsets)
        head_from, i32_from, i16_from, i64_from = (_STORED_HEAD.unpack_from, _I32.unpack_from, _I16.unpack_from,
                                                   _I64.unpack_from)
        targets, target_of = self._targets, self._target
        max_delay, max_body, broker = self.limits.max_delay_ms, self._max_body, out.broker
        queue_id, queue = -1, ""
        p = row = 0
        last = -1
        compiled = self._compiled
        queue_names: dict[int, str] = {}
        while p < n:
            if compiled is not None:
                p, taken, at_last = compiled(body, p, now, max_delay, max_body, _ROLES, self._target_bytes,
                                             queue_names, broker, _WALK_LIMITS, crc32c.crc32c,
                                             blobs, ids, dues, lengths, key_col, queues, offsets, at)
                if taken:
                    row, last = row + taken, at_last
                if p >= n:
                    break
            # one message the compiled loop left (or every message, without it)
            if p + _HEAD_SIZE > n:
                raise MessageDecodeError("cut short", decoded=[], raw=b"")  # decode_messages says where
            total, magic, _crc, qid, _flag, qoff, phys, sys_flag, born = head_from(mv, p)
            end = p + total
            if total < _HEAD_SIZE or end > n or (magic != _MAGIC_V1 and magic != _MAGIC_V2):
                raise MessageDecodeError("bad frame", decoded=[], raw=b"")
            # ---- the fixed fields, then body, topic and properties, each within the message
            host = p + _HEAD_SIZE + (20 if sys_flag & _BORNHOST_V6 else 8) + 8  # past born host, store time
            q = host + (20 if sys_flag & _STOREHOST_V6 else 8) + 12  # past store host, reconsumes, prepared
            fast = not sys_flag & COMPRESSED and q + 4 <= end
            body_len = b0 = t0 = plen = 0
            if fast:
                (body_len,) = i32_from(mv, q)
                b0 = q + 4
                q = b0 + body_len
                if body_len < 0 or q + 3 > end:
                    fast = False
                elif magic == _MAGIC_V1:
                    t0 = q + 1
                    q = t0 + mv[q]
                else:
                    (tlen,) = i16_from(mv, q)
                    t0 = q + 2
                    q = t0 + tlen
                    fast = tlen >= 0
                fast = fast and q + 2 <= end and body[t0:q].isascii()
            if fast:
                (plen,) = i16_from(mv, q)
                q += 2
                fast = 0 <= plen and q + plen <= end
            text = ""
            if fast:
                try:
                    text = str(mv[q:q + plen], "utf-8")
                except UnicodeDecodeError:
                    fast = False
            d: dict[str, str] = {}
            if fast and text and text[-1] == PROPERTY_SEPARATOR and "\x00" not in text and "\ufffd" not in text:
                pairs = text[:-1].split(PROPERTY_SEPARATOR)
                try:
                    d = dict(map(_SPLIT_PAIR, pairs))
                except ValueError:  # a pair without a separator
                    fast = False
                # no separator in a value, no control property
                fast = fast and len(pairs) == text.count(NAME_VALUE_SEPARATOR) and CONTROL_PROPERTIES.isdisjoint(d)
                if fast and len(d) != len(pairs) and len(set(pairs)) != len(d):
                    # A name repeated with another value (a broker stores each message of a batch with the
                    # batch's properties after its own: WAIT again, and from RocketMQ's Java client the
                    # batch's UNIQ_KEY): the last value holds, as in `split_properties`, but UNIQ_KEY keeps
                    # its first, the message's own. (With one value, the distinct pairs are as many as the names.)
                    for pair in pairs:
                        if pair.startswith(_UNIQ_KEY_PAIR):
                            d[UNIQ_KEY] = pair[len(_UNIQ_KEY_PAIR):]
                            break
            else:
                fast = False
            # ---- the contract, for messages that meet it without a doubt
            due = -1
            when = ""  # the id's due part: the due time, or '+' and the delay (`contract.engine_id`)
            if fast:
                target = d.get(TARGET_TOPIC)
                tb = None if target is None else (targets.get(target) or target_of(target))
                if tb is None:
                    fast = False
                else:
                    raw = d.get(DELIVER_AT_MS)
                    if raw is None:
                        raw = d.get(DELAY_MS)
                        if raw is not None:
                            if raw.isdigit() and raw.isascii() and len(raw) <= _MAX_DIGITS:
                                delay = int(raw)
                                due = delay_base(born, i64_from(mv, host - 8)[0], now) + delay
                                when = f"+{delay}"
                            raw = None
                        else:
                            raw = d.get(START_DELIVER_TIME)
                    if raw is not None and raw.isdigit() and raw.isascii() and len(raw) <= _MAX_DIGITS:
                        due = int(raw)
                    fast = 0 <= due and due - now <= max_delay and body_len <= max_body
            if fast:
                tags = d.get(TAGS, "")
                keys = d.get(KEYS, "")
                key_list: tuple[str, ...] = ()
                if keys:
                    key_list = tuple(keys.split(" "))
                    if "" in key_list:
                        key_list = tuple(filter(None, key_list))
                carried = None
                if not _NOT_CARRIED.issuperset(d):
                    carried = {k: v for k, v in d.items() if k not in _NOT_CARRIED and not k.startswith(_TRANSIENT_PREFIX)}
                uniq = d.get(UNIQ_KEY) or (body[host:host + (20 if sys_flag & _STOREHOST_V6 else 8)]
                                           + _I64.pack(phys)).hex().upper()
                due_text = str(due)
                chosen = join_properties(dict(sorted(carried.items()))) if carried else ""
                ident = f"{target}\x00{when or due_text}\x00{tags}\x00{keys}\x00{chosen}".encode()
                payload = mv[b0:b0 + body_len]
                msg_id = f"{uniq}:{crc32c.crc32c(payload, crc32c.crc32c(ident)):08x}"
                idb = msg_id.encode()
                tagb = tags.encode() if tags else b""
                kb = encode_keys(key_list) if key_list else b""
                # every property delivered is one of the stored ones, or the id or the due time
                fast = (plen + _DELIVERY_ADDS + len(idb) + len(due_text) <= DELIVERY_PROPERTIES_BUDGET
                        and len(idb) <= MAX_FIELD and len(tagb) <= MAX_FIELD and len(kb) <= MAX_FIELD)
                if fast:
                    if qid != queue_id:
                        queue_id, queue = qid, f"{broker}:{qid}"
                    blobs.append(encode_fields(due, now, idb, tb, tagb, kb,  # type: ignore[arg-type]
                                               encode_properties(carried) if carried else b"", payload))
                    ids.append(msg_id)
                    dues.append(due)
                    lengths.append(body_len)
                    key_col.append(key_list)
                    queues.append(queue)
                    offsets.append(qoff)
                    at.append(p)
            if not fast:
                got = decode_messages(body[p:end], out.max_body_bytes, broker, budget)
                if not got:  # the commit's inflate budget stopped reading here
                    break
                general.append(got[0])
                general_at.append(row)
            last = qoff
            row += 1
            p = end
        out.count, out.last = row, last
