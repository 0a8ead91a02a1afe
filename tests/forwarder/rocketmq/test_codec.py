"""The codec: the batch layout a producer sends and the store layout a pull returns, pinned in bytes."""
from __future__ import annotations

import struct
import zlib

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


_V1, _V2 = -626843481, -626843485


def stored(body: bytes, topic: str, props: dict[str, str], *, v2: bool = False, ipv6: bool = False,
           compress: bool = False, queue_offset: int = 7) -> bytes:
    """One message as a broker's store (and so a pull answer) lays it out."""
    sys_flag = (0x10 | 0x20 if ipv6 else 0) | (1 if compress else 0)
    payload = zlib.compress(body) if compress else body
    host = b"\x00" * (20 if ipv6 else 8)
    t = topic.encode()
    p = "".join(f"{k}\x01{v}\x02" for k, v in props.items()).encode()
    rest = (struct.pack(">q", 1_700_000_000_123) + host + struct.pack(">iq", 2, 0) + struct.pack(">i", len(payload))
            + payload + (struct.pack(">h", len(t)) if v2 else bytes([len(t)])) + t + struct.pack(">h", len(p)) + p)
    head = struct.pack(">iiiiiqqiq", 0, _V2 if v2 else _V1, 0, 3, 0, queue_offset, 4096, sys_flag, 1_700_000_000_000)
    first = head + host
    total = len(first) + len(rest)
    return struct.pack(">i", total) + first[4:] + rest


props_st = st.dictionaries(st.text(st.characters(blacklist_characters="\x00\x01\x02", blacklist_categories=("Cs",)),
                                   min_size=1, max_size=8),
                           st.text(st.characters(blacklist_characters="\x00\x01\x02", blacklist_categories=("Cs",)),
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


def test_without_uniq_key_the_id_is_the_offset_id() -> None:
    [m] = decode_messages(stored(b"b", "T", {}))
    assert m.msg_id == ("00" * 8) + f"{4096:016X}"


@pytest.mark.parametrize("raw", [b"\x00\x00", stored(b"x", "T", {})[:-3], b"\x00\x00\x00\x30" + b"\x01" * 44])
def test_truncated_or_foreign_bytes_are_refused(raw: bytes) -> None:
    with pytest.raises(MessageDecodeError):
        decode_messages(raw)
