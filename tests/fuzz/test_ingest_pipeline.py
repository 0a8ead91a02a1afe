"""The whole ingest pipeline under arbitrary RocketMQ messages: every message pulled from the delay
topic ends delivered-encodable (stored, and its delivery encodes within RocketMQ's limits) or
dead-letterable (its dead letter encodes within them), in bounded memory.

    decode (a pull answer's bytes: any properties, sizes, codecs, flags)
      -> contract (a delay message, a cancel, or a violation)
      -> store (the engine's own validation, then the schedule log)
      -> delivery encode (the stored bytes, as the dispatcher sends them, with a replica's stamp)
      -> dead-letter encode (for a violation, an unreadable message, or a delivery that fails)

A bounded number of examples runs with the tests; more by one command:

    TIMEWHEEL_FUZZ_EXAMPLES=20000 .venv/bin/python -m pytest tests/fuzz -q -p no:randomly \\
        --hypothesis-show-statistics

(`--hypothesis-seed=N` to vary the inputs from one run to the next).
"""
from __future__ import annotations

import os
import struct
import tracemalloc
import zlib
from collections.abc import Iterator, Sequence

import lz4.frame
import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from forwarder._ingest_pass import OnePass
from forwarder.contract import (TARGET_TOPIC, ContractLimits, ContractViolation, raw_dead_letter, to_dead_letter,
                                to_message)
from forwarder.control import split_control, to_cancel
from forwarder.record_encoding import encode_records
from forwarder.rocketmq import MessageDecodeError, encode_message
from forwarder.rocketmq.codec import decode_messages
from forwarder.rocketmq.compression import InflateBudget
from timewheel import Engine, EngineConfig, InvalidMessageError, ManualClock, Message

EXAMPLES = int(os.environ.get("TIMEWHEEL_FUZZ_EXAMPLES", "150"))
NOW = 1_800_000_000_000
MAX_BODY = 64 * 1024  # small, so that bodies around and past the bound are cheap to make
COMMIT_BUDGET = 256 * 1024
#: a generous bound on what one pull answer may cost in memory (what it inflates to, and copies)
MEMORY_BOUND = 32 << 20
LIMITS = ContractLimits(max_delay_ms=2 * 366 * 86_400_000, max_body_bytes=MAX_BODY,
                        reserved_topics=frozenset({"TW_DELAY", "TW_DLQ"}))
_V1, _V2 = -626843481, -626843477
_ID = "0" * 32


class _Sink:
    """No sends: the fuzz reads stored records back and encodes them as the dispatcher would."""

    def send_batch(self, messages: Sequence[Message]) -> list[bool]:
        return [False] * len(messages)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    e = Engine(EngineConfig(tmp_path_factory.mktemp("fuzz"), max_body_bytes=MAX_BODY), _Sink(),
               ManualClock(NOW), seed=1).start(background=False)
    try:
        yield e
    finally:
        e.stop()


# ---- what a broker may hand over --------------------------------------------------------------

_any_text = st.text(st.characters(blacklist_categories=["Cs"]), max_size=12)
_nasty = st.sampled_from(["", " ", "\t", "\x00", "\x01", "\x02", "\ufffd", "ü", "%DLQ%", " k ", "a b"])
_sizes = st.sampled_from([0, 1, 100, 4_000, 31_700, 32_590, 32_650, 32_700, 32_760])
_valid_topic = st.sampled_from(["ORDERS", "PAYMENTS_2", "t-1"])
_topic = st.one_of(_valid_topic, _valid_topic, _valid_topic, st.sampled_from(["ORDERS", "%DLQ%orders", "%RETRY%g", "SCHEDULE_TOPIC_XXXX", "RMQ_SYS_TRANS_HALF_TOPIC",
                                    "TW_DELAY", "TW_DLQ", "bad topic", "", "x" * 130]), _any_text)
_valid_millis = st.integers(0, 366 * 86_400_000).map(lambda d: str(NOW + d))
_millis = st.one_of(_valid_millis, _valid_millis, _valid_millis, st.integers(-(1 << 64), 1 << 64).map(str),
                    st.sampled_from(["", " 5", "1e3", "tomorrow", "٣"]),
                    st.integers(0, 3 * 366 * 86_400_000).map(lambda d: str(NOW + d)))


@st.composite
def _properties(draw: st.DrawFn) -> dict[str, str]:
    props: dict[str, str] = {}
    if draw(st.integers(0, 4)):
        props[TARGET_TOPIC] = draw(_topic)
    for name in draw(st.lists(st.sampled_from(["TW_DELAY_MS", "TW_DELIVER_AT_MS", "__STARTDELIVERTIME"]),
                              min_size=draw(st.integers(0, 1)), max_size=2)):
        props[name] = draw(_millis)
    if draw(st.integers(0, 5)) == 0:
        props[draw(st.sampled_from(["TW_CANCEL_ID", "TW_CANCEL_KEY"]))] = draw(st.one_of(_nasty, _any_text))
    for _ in range(draw(st.integers(0, 3))):
        name = draw(st.one_of(st.sampled_from(["p", "TW_DEAD_LETTER_REASON", "TW_ORIGINAL_MSG_ID", "UNIQ_KEY",
                                               "TAGS", "KEYS", "WAIT", "TW_DUE_MS"]), _any_text))
        value = draw(st.one_of(_nasty, _any_text, _sizes.map(lambda n: "v" * n)))
        props[name] = value
    return props


def _compress(codec: int, body: bytes) -> bytes:
    if codec in (0, 3):
        return zlib.compress(body)
    if codec == 1:
        return lz4.frame.compress(body)
    return zstandard.ZstdCompressor().compress(body)


@st.composite
def _stored(draw: st.DrawFn, offset: int) -> bytes:
    """One message as a broker's store lays it out (properties at most what its int16 length holds)."""
    props = draw(_properties())
    text = "".join(f"{k}\x01{v}\x02" for k, v in props.items()).encode("utf-8", "surrogatepass")
    if len(text) > 32_767:
        text = text[:32_767]
    body = draw(st.one_of(st.binary(max_size=64), st.sampled_from([b"", b"z" * 2000]),
                          st.integers(0, 3 * MAX_BODY).map(lambda n: b"\x00" * n)))
    codec = draw(st.sampled_from([None, None, None, 0, 1, 2, 3, 5]))
    payload = body if codec is None else (_compress(codec, body) if codec != 5 else body)
    if codec is not None and draw(st.integers(0, 9)) == 0:
        payload = payload[:draw(st.integers(0, len(payload)))]  # cut short
    sys_flag = (0 if codec is None else 1 | codec << 8) | draw(st.sampled_from([0, 0x10 | 0x20]))
    topic = draw(st.sampled_from([b"TW_DELAY"] * 5 + [b"\xff\xfe"]))
    return stored_message(text, payload, sys_flag, offset, topic=topic, v2=draw(st.booleans()))


def stored_message(props: bytes, payload: bytes, sys_flag: int, offset: int, *, topic: bytes = b"TW_DELAY",
                   v2: bool = False) -> bytes:
    """The bytes a broker's store (and so a pull answer) holds for one message."""
    host = b"\x00" * (20 if sys_flag & 0x10 else 8)
    rest = (struct.pack(">q", NOW - 10) + host + struct.pack(">iq", 0, 0) + struct.pack(">i", len(payload)) + payload
            + (struct.pack(">h", len(topic)) if v2 else bytes([len(topic)])) + topic + struct.pack(">h", len(props))
            + props)
    head = struct.pack(">iiiiiqqiq", 0, _V2 if v2 else _V1, 0, 1, 0, offset, 4096 + offset, sys_flag, NOW - 10)
    first = head + host
    return struct.pack(">i", len(first) + len(rest)) + first[4:] + rest


@st.composite
def _pull_answer(draw: st.DrawFn) -> bytes:
    raw = b"".join(draw(_stored(offset)) for offset in range(draw(st.integers(1, 4))))
    if draw(st.integers(0, 9)) == 0:  # a framing fault: bytes cut or flipped
        raw = raw[:draw(st.integers(0, len(raw)))]
    return raw


# ---- what must hold for each -----------------------------------------------------------------

def _dead_letterable(letter_of: object) -> None:
    """The dead letter encodes within RocketMQ's limits (raises if it does not)."""
    encode_message(letter_of, _ID)  # type: ignore[arg-type]


def _deliverable(engine: Engine, msg_id: str) -> None:
    """The stored record's delivery, as the dispatcher encodes it with a replica's stamp, fits RocketMQ."""
    store = engine.store
    assert store is not None
    [loc] = store.meta.locations([msg_id])
    assert loc is not None
    rb = store.read_record_bytes(np.array([loc.segment_ms]), np.array([loc.part]), np.array([loc.offset]))
    assert rb.ok.all(), rb.errors
    [encoded] = encode_records(rb, [_ID], {"TW_LEASE_EPOCH": str((1 << 63) - 1)})
    assert isinstance(encoded, bytes), encoded
    # and should every attempt fail, its dead letter (as the delivery sink writes it) fits too
    m = Message.from_record(rb.record(0))
    props = {**(m.properties or {}), TARGET_TOPIC: m.topic}
    _dead_letterable(to_dead_letter("TW_DLQ", m.body, m.tags, " ".join(m.keys), props, "not delivered after 16 "
                                    "attempts", msg_id=m.msg_id or ""))


def _one_pass_agrees(raw: bytes) -> None:
    """Ingest's one pass reads the answer as the codec does: the same framing faults, and the
    codec's own messages wherever it does not write the record itself."""
    one = OnePass(LIMITS, lambda: NOW)
    try:
        decoded = decode_messages(raw, MAX_BODY, budget=InflateBudget(COMMIT_BUDGET))
    except MessageDecodeError as e:
        with pytest.raises(MessageDecodeError) as got:
            one.read(raw, MAX_BODY, "", InflateBudget(COMMIT_BUDGET))
        assert (got.value.decoded, got.value.raw) == (e.decoded, e.raw)
        return
    answer = one.read(raw, MAX_BODY, "", InflateBudget(COMMIT_BUDGET))
    assert len(answer) == len(decoded) and answer.general == [decoded[i] for i in answer.general_at]


def _one(engine: Engine, raw: bytes) -> list[str]:
    """Take one pull answer through the pipeline, checking each message's ending; the endings."""
    endings: list[str] = []
    _one_pass_agrees(raw)
    try:
        batch = decode_messages(raw, MAX_BODY, budget=InflateBudget(COMMIT_BUDGET))
    except MessageDecodeError as e:
        endings.append("framing fault: the rest goes raw")
        _dead_letterable(raw_dead_letter("TW_DLQ", e.raw, str(e), 1, 0))
        batch = e.decoded
    messages, control = split_control(batch)
    for msg in control:
        try:
            to_cancel(msg, NOW)
            endings.append("cancel")
        except ContractViolation as e:
            endings.append("cancel refused: dead letter")
            _dead_letterable(to_dead_letter("TW_DLQ", msg.body, msg.tags, msg.keys, msg.properties, e.reason,
                                            msg_id=msg.msg_id, queue_id=msg.queue_id, queue_offset=msg.queue_offset))
    for msg in messages:
        if msg.undecodable:
            endings.append("unreadable: raw dead letter")
            _dead_letterable(raw_dead_letter("TW_DLQ", msg.body, msg.undecodable, msg.queue_id, msg.queue_offset,
                                             msg_id=msg.msg_id, keys=msg.keys or None, properties=msg.properties))
            continue
        try:
            m = to_message(msg, NOW, LIMITS)
            [stored_id] = engine.schedule([m])
        except (ContractViolation, InvalidMessageError) as e:
            endings.append("refused: dead letter")
            reason = e.reason if isinstance(e, ContractViolation) else str(e)
            _dead_letterable(to_dead_letter("TW_DLQ", msg.body, msg.tags, msg.keys, msg.properties, reason,
                                            msg_id=msg.msg_id, queue_id=msg.queue_id, queue_offset=msg.queue_offset))
            continue
        endings.append("stored: delivery encodes")
        _deliverable(engine, stored_id)
    return endings


# a failing example's bytes run to tens of KB: reported whole, not turned into a warning-as-error
@pytest.mark.filterwarnings("ignore:Generating overly large repr:hypothesis.errors.HypothesisWarning")
@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example,
                                 HealthCheck.function_scoped_fixture])
@given(_pull_answer())
def test_every_pulled_message_is_deliverable_or_dead_letterable(engine: Engine, raw: bytes) -> None:
    tracemalloc.start()
    try:
        for ending in _one(engine, raw):
            event(ending)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MEMORY_BOUND + 8 * len(raw), f"one pull answer of {len(raw)} bytes took {peak} bytes"


def test_the_harness_reaches_every_ending(engine: Engine) -> None:
    """Fixed inputs of each kind reach each ending, so that a pass of the fuzz means something."""
    def props(**p: str) -> bytes:
        return "".join(f"{k}\x01{v}\x02" for k, v in p.items()).encode()
    good = stored_message(props(TW_TARGET_TOPIC="ORDERS", TW_DELAY_MS="5", UNIQ_KEY="A" * 32), b"b", 0, 0)
    big = stored_message(props(BIG="x" * 32_600), b"b", 0, 1)  # no target, and a dead letter too big to keep it
    edge = stored_message(props(TW_TARGET_TOPIC="ORDERS", TW_DELAY_MS="5", A="x" * 32_600), b"b", 0, 2)
    cancel = stored_message(props(TW_CANCEL_KEY="k\tx"), b"c", 0, 3)
    bad_cancel = stored_message(props(TW_CANCEL_KEY="a b"), b"c", 0, 4)
    unreadable = stored_message(props(TW_TARGET_TOPIC="ORDERS"), b"not zlib", 1 | 3 << 8, 5)
    endings = _one(engine, good + big + edge + cancel + bad_cancel + unreadable)
    assert sorted(endings) == sorted(["stored: delivery encodes", "refused: dead letter", "refused: dead letter",
                                      "cancel", "cancel refused: dead letter", "unreadable: raw dead letter"])
    assert _one(engine, good[:-3]) == ["framing fault: the rest goes raw"]
