"""The codec: the batch layout a producer sends and the store layout a pull returns, pinned in bytes."""
from __future__ import annotations

import struct
import zlib

import lz4.frame
import zstandard

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forwarder.rocketmq import MessageDecodeError, MessageRejectedError, OutgoingMessage, decode_messages, encode_message

_PROPS = "p\x01v\x02TAGS\x01t\x02KEYS\x01k1 k2\x02WAIT\x01true\x02UNIQ_KEY\x01ID\x02"


@pytest.mark.parametrize("msg,expected", [
    pytest.param(
        OutgoingMessage("T", b"\x00\x01", tags="t", keys="k1 k2", properties={"p": "v"}),
        struct.pack(">iiiii", 20 + 2 + 2 + len(_PROPS), 0, 0, 0, 2) + b"\x00\x01"
        + struct.pack(">h", len(_PROPS)) + _PROPS.encode(),
        id="binary-body-tags-keys-property",
    ),
    pytest.param(
        OutgoingMessage("T", b""),
        bytes.fromhex("0000002c 00000000 00000000 00000000 00000000 0016") + b"WAIT\x01true\x02UNIQ_KEY\x01ID\x02",
        id="empty-body-no-tags",
    ),
    pytest.param(
        OutgoingMessage("T", b"x", properties={"名": "Zoë"}),
        bytes.fromhex("00000036 00000000 00000000 00000000 00000001") + b"x" + bytes.fromhex("001f")
        + "名\x01Zoë\x02WAIT\x01true\x02UNIQ_KEY\x01ID\x02".encode(),
        id="utf8-property-length-in-bytes",
    ),
])
def test_encode_message_pins_the_batch_layout(msg: OutgoingMessage, expected: bytes) -> None:
    assert encode_message(msg, "ID") == expected


def test_encode_message_lets_the_message_fields_win_over_same_named_properties() -> None:
    data = encode_message(OutgoingMessage("T", b"", tags="real", properties={"TAGS": "fake", "UNIQ_KEY": "x"}), "ID")
    props = data[22:].decode()
    assert "TAGS\x01real\x02" in props and "fake" not in props and "UNIQ_KEY\x01ID\x02" in props


@pytest.mark.parametrize("props", [{"a\x01": "v"}, {"a": "v\x02w"}, {"a": "nul\x00"}, {"big": "x" * 40000}])
def test_encode_message_refuses_what_rocketmq_cannot_carry(props: dict[str, str]) -> None:
    with pytest.raises(MessageRejectedError) as err:
        encode_message(OutgoingMessage("T", b"", properties=props), "ID")
    assert not err.value.retriable


_V1, _V2 = -626843481, -626843477


def stored(body: bytes, topic: str, props: dict[str, str], *, v2: bool = False, ipv6: bool = False,
           compress: bool = False, queue_offset: int = 7, codec: int | None = None,
           payload: bytes | None = None) -> bytes:
    """One message as a broker's store (and so a pull answer) lays it out (`codec`: compressed with it,
    as RocketMQ numbers them; `payload`: stored body bytes as given)."""
    sys_flag = (0x10 | 0x20 if ipv6 else 0) | (1 if compress or codec is not None else 0) | ((codec or 0) << 8)
    if payload is None:
        payload = _compressed(codec, body) if codec is not None else zlib.compress(body) if compress else body
    host = b"\x00" * (20 if ipv6 else 8)
    t = topic.encode()
    p = "".join(f"{k}\x01{v}\x02" for k, v in props.items()).encode()
    rest = (struct.pack(">q", 1_700_000_000_123) + host + struct.pack(">iq", 2, 0) + struct.pack(">i", len(payload))
            + payload + (struct.pack(">h", len(t)) if v2 else bytes([len(t)])) + t + struct.pack(">h", len(p)) + p)
    head = struct.pack(">iiiiiqqiq", 0, _V2 if v2 else _V1, 0, 3, 0, queue_offset, 4096, sys_flag, 1_700_000_000_000)
    first = head + host
    total = len(first) + len(rest)
    return struct.pack(">i", total) + first[4:] + rest


def _compressed(codec: int, body: bytes) -> bytes:
    if codec in (0, 3):
        return zlib.compress(body)
    if codec == 1:
        return lz4.frame.compress(body)
    return zstandard.ZstdCompressor().compress(body)


props_st = st.dictionaries(st.text(st.characters(blacklist_characters="\x00\x01\x02", blacklist_categories=["Cs"]),
                                   min_size=1, max_size=8),
                           st.text(st.characters(blacklist_characters="\x00\x01\x02", blacklist_categories=["Cs"]),
                                   max_size=16), max_size=5)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.binary(max_size=300), props_st, st.booleans(), st.booleans(), st.booleans()),
                min_size=1, max_size=5))
def test_decode_reads_back_what_the_store_holds(items: list[tuple[bytes, dict[str, str], bool, bool, bool]]) -> None:
    raw = b"".join(stored(b, "TOPIC_A", {**p, "UNIQ_KEY": f"ID{i}", "TAGS": "tg"}, v2=v2, ipv6=v6, compress=z)
                   for i, (b, p, v2, v6, z) in enumerate(items))
    got = decode_messages(raw)
    assert [m.body for m in got] == [b for b, *_ in items]
    for i, (m, (_, p, *_)) in enumerate(zip(got, items)):
        assert (m.topic, m.msg_id, m.tags, m.queue_id, m.queue_offset, m.born_timestamp) == (
            "TOPIC_A", f"ID{i}", "tg", 3, 7, 1_700_000_000_000)
        assert {k: v for k, v in m.properties.items() if k not in ("UNIQ_KEY", "TAGS")} == \
            {k: v for k, v in p.items() if k not in ("UNIQ_KEY", "TAGS")}


def test_a_message_of_a_topic_over_127_bytes_is_read_in_the_layout_the_broker_writes_it() -> None:
    """A broker stores a message whose topic is over 127 bytes (a retry topic of a long group name)
    with MessageDecoder.MESSAGE_MAGIC_CODE_V2, 0xdaa320ab, and the topic's length in 2 bytes."""
    topic = "%RETRY%" + "g" * 130
    raw = bytearray(stored(b"body", topic, {"UNIQ_KEY": "ID1"}, v2=True))
    raw[4:8] = bytes.fromhex("daa320ab")  # as rocketmq-common 5.3.3 has it, whatever the helper says
    [m] = decode_messages(bytes(raw))
    assert (m.topic, m.body, m.msg_id, m.undecodable) == (topic, b"body", "ID1", None)


def test_without_uniq_key_the_id_is_the_offset_id() -> None:
    [m] = decode_messages(stored(b"b", "T", {}))
    assert m.msg_id == ("00" * 8) + f"{4096:016X}"


@pytest.mark.parametrize("raw", [b"\x00\x00", stored(b"x", "T", {})[:-3], b"\x00\x00\x00\x30" + b"\x01" * 44])
def test_truncated_or_foreign_bytes_are_refused(raw: bytes) -> None:
    with pytest.raises(MessageDecodeError):
        decode_messages(raw)


@pytest.mark.parametrize("codec", [pytest.param(c, id=n) for c, n in ((0, "zlib-legacy"), (1, "lz4"), (2, "zstd"),
                                                                       (3, "zlib"))])
def test_every_codec_a_java_producer_writes_is_read_back(codec: int) -> None:
    body = bytes(range(256)) * 40  # 10 KiB: over the Java client's 4 KiB default threshold
    [m] = decode_messages(stored(body, "T", {"UNIQ_KEY": "ID1"}, codec=codec))
    assert m.body == body and m.undecodable is None


@pytest.mark.parametrize("codec,payload,why", [
    pytest.param(3, zlib.compress(b"\0" * (8 << 20)), "inflates past the limit", id="zlib-bomb"),
    pytest.param(2, zstandard.ZstdCompressor().compress(b"\0" * (8 << 20)), "inflates past the limit", id="zstd-bomb"),
    pytest.param(1, b"not lz4 at all", "corrupt", id="garbled-lz4"),
    pytest.param(5, b"xx", "compression type 5", id="unknown-codec"),
])
def test_an_unreadable_body_comes_back_raw_beside_readable_ones(codec: int, payload: bytes, why: str) -> None:
    bad = stored(b"", "T", {"UNIQ_KEY": "BAD"}, codec=codec, payload=payload, queue_offset=8)
    good = [stored(b"ok%d" % i, "T", {"UNIQ_KEY": f"G{i}"}, queue_offset=7 + 2 * i) for i in range(2)]
    got = decode_messages(good[0] + bad + good[1], max_body_bytes=4 << 20)
    assert [m.undecodable is None for m in got] == [True, False, True]
    assert why in (got[1].undecodable or "")
    assert got[1].body == bad and got[1].queue_offset == 8 and got[1].msg_id == "BAD"
    assert [got[0].body, got[2].body] == [b"ok0", b"ok1"]


def test_a_framing_fault_carries_what_was_read_before_it_and_the_rest() -> None:
    good = stored(b"ok", "T", {"UNIQ_KEY": "G"})
    with pytest.raises(MessageDecodeError) as e:
        decode_messages(good + b"\x00\x00\x00\x30" + b"\x01" * 44)
    assert [m.body for m in e.value.decoded] == [b"ok"]
    assert e.value.raw == b"\x00\x00\x00\x30" + b"\x01" * 44


@settings(max_examples=500, deadline=200)
@given(st.binary(max_size=600), st.integers(0, 600), st.binary(max_size=8))
def test_any_bytes_decode_or_raise_a_decode_error(noise: bytes, at: int, patch: bytes) -> None:
    base = stored(b"hello", "T", {"UNIQ_KEY": "X", "a": "b"}, codec=3) + stored(b"x" * 50, "T", {})
    for raw in (noise, base[:at] + patch + base[at + len(patch):]):
        try:
            out = decode_messages(raw, max_body_bytes=1 << 16)
        except MessageDecodeError:
            continue
        assert all(len(m.body) <= max(len(raw), 1 << 16) for m in out)


def test_a_repeated_uniq_key_keeps_its_first_value_and_other_names_their_last() -> None:
    from forwarder.rocketmq.message import split_properties

    # How a broker stores a message of a batch send: its own properties, then the batch's.
    text = "UNIQ_KEY\x01own\x02WAIT\x01false\x02UNIQ_KEY\x01batch\x02WAIT\x01true\x02"
    assert split_properties(text) == {"UNIQ_KEY": "own", "WAIT": "true"}


def test_a_commit_inflates_at_most_its_budget_plus_one_message() -> None:
    from forwarder.rocketmq.compression import InflateBudget
    mib = 1 << 20
    raw = b"".join(stored(bytes([i]) * mib, "T", {"UNIQ_KEY": f"Z{i}"}, codec=3, queue_offset=10 + i)
                   for i in range(8))
    assert len(raw) < 100_000  # a few KB on the wire
    budget = InflateBudget(3 * mib)
    got = decode_messages(raw, 4 * mib, budget=budget)
    assert [m.queue_offset for m in got] == [10, 11, 12] and budget.stopped
    assert all(m.undecodable is None for m in got)
    # the next commit goes on from there; the first message of a commit always goes
    rest = b"".join(stored(bytes([i]) * mib, "T", {"UNIQ_KEY": f"Z{i}"}, codec=3, queue_offset=10 + i)
                    for i in range(3, 8))
    assert len(decode_messages(rest, 4 * mib, budget=InflateBudget(0))) == 1
    # a commit's second answer shares the budget: nothing more once it is spent
    spent = InflateBudget(mib)
    decode_messages(rest[:len(rest) // 5], 4 * mib, budget=spent)
    assert decode_messages(rest, 4 * mib, budget=spent) == [] and spent.stopped


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=80), st.integers(0, 4_102_444_800_000))
def test_a_derived_id_is_the_keyed_hash_around_the_ms_since_the_utc_month_start_12_hours_early(seed: bytes,
                                                                                               at_ms: int) -> None:
    import calendar
    import hashlib
    import time

    from forwarder.rocketmq.codec import derived_id

    h = hashlib.blake2b(seed, digest_size=12, key=b"timewheel.uniq.v1").digest()
    t = at_ms - 12 * 3600 * 1000
    g = time.gmtime(t // 1000)
    since = t - calendar.timegm((g.tm_year, g.tm_mon, 1, 0, 0, 0)) * 1000
    assert derived_id(seed, at_ms) == (h[:10] + struct.pack(">I", since) + h[10:]).hex().upper()


def test_the_compiled_derived_id_is_built() -> None:
    from forwarder.rocketmq import codec

    assert codec.COMPILED_IDS, "forwarder/rocketmq/_uniq_key.pyx was not built: run `make setup` again"


@settings(max_examples=2000, deadline=None)
@given(st.one_of(st.binary(max_size=400), st.binary(min_size=127, max_size=130), st.binary(min_size=255, max_size=257)),
       st.one_of(st.integers(-62_135_596_800_000 + 12 * 3600 * 1000, 253_399_622_399_999),
                 st.integers(1_700_000_000_000, 1_900_000_000_000),
                 st.sampled_from([951_782_400_000 + 12 * 3600 * 1000 + d for d in (-1, 0, 1)])))
def test_the_compiled_derived_id_is_the_python_one_byte_for_byte(seed: bytes, at_ms: int) -> None:
    """Every seed length around BLAKE2b's 128-byte blocks, any time from year 1 to November 9999 (month and leap
    day edges included): the same 32 digits as the reference, and as hashlib's keyed hash."""
    import hashlib

    from forwarder.rocketmq import _uniq_key, codec

    want = codec._reference_derived_id(seed, at_ms)
    assert _uniq_key.derived_id(seed, at_ms) == want
    h = hashlib.blake2b(seed, digest_size=12, key=b"timewheel.uniq.v1").digest()
    assert bytes.fromhex(want)[:10] == h[:10] and bytes.fromhex(want)[14:] == h[10:]


@pytest.mark.parametrize("seed, at_ms", [(bytearray(b"m"), 1_790_000_000_000), (b"m", True),
                                         (b"m", 2**70), (b"m", -(2**70)), (b"m", 253_402_300_800_000),
                                         (b"m", 253_399_665_600_000), (b"m", -62_135_596_800_000)])
def test_what_the_compiled_derived_id_does_not_take_goes_to_the_reference(seed: object, at_ms: object) -> None:
    """A seed that is not bytes, a time that is not an int or lies outside year 1 to November 9999: answered, or
    refused, as the Python function answers or refuses it."""
    from forwarder.rocketmq import _uniq_key, codec

    try:
        want: object = codec._reference_derived_id(seed, at_ms)  # type: ignore[arg-type]
    except Exception as e:  # noqa: BLE001 - the same error either way is the point
        want = type(e)
    try:
        got: object = _uniq_key.derived_id(seed, at_ms)  # type: ignore[arg-type]  # any value, as the reference
    except Exception as e:  # noqa: BLE001
        got = type(e)
    assert got == want
