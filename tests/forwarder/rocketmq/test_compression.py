"""Compressed bodies as every RocketMQ producer writes them are read back, under the size bound."""
from __future__ import annotations

import zlib

import lz4.frame
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from forwarder.rocketmq.compression import (LZ4, ZLIB, ZLIB_LEGACY, ZSTD, BodyDecodeError, BodyTooLargeError,
                                            codec_of, decompress)


def _flag(codec: int) -> int:
    return 0x1 | codec << 8


def _compress(codec: int, data: bytes) -> bytes:
    if codec in (ZLIB, ZLIB_LEGACY):
        return zlib.compress(data)
    if codec == LZ4:
        return lz4.frame.compress(data)
    return zstandard.ZstdCompressor().compress(data)


CODECS = [pytest.param(c, id=n) for c, n in ((ZLIB_LEGACY, "zlib-legacy"), (ZLIB, "zlib"), (LZ4, "lz4"),
                                               (ZSTD, "zstd"))]


@pytest.mark.parametrize("codec", CODECS)
@given(data=st.binary(max_size=20_000))
@settings(max_examples=60, deadline=None)
def test_round_trip(codec: int, data: bytes) -> None:
    assert decompress(_compress(codec, data), _flag(codec), 1 << 20) == data


def test_an_uncompressed_body_is_returned_as_stored() -> None:
    assert codec_of(0x4) is None
    assert decompress(b"\x78raw", 0x4, 10) == b"\x78raw"


@pytest.mark.parametrize("codec", CODECS)
def test_a_bomb_stops_at_the_limit(codec: int) -> None:
    bomb = _compress(codec, b"\0" * (64 << 20))  # 64 MiB of zeros in a few KiB
    assert len(bomb) < 1 << 20
    with pytest.raises(BodyTooLargeError, match="inflates past the limit of 4194304"):
        decompress(bomb, _flag(codec), 4 << 20)


@pytest.mark.parametrize("codec", CODECS)
@given(data=st.binary(min_size=1, max_size=5000), cut=st.integers(min_value=1, max_value=50))
@settings(max_examples=40, deadline=None)
def test_truncated_or_garbled_bodies_are_refused_not_misread(codec: int, data: bytes, cut: int) -> None:
    packed = _compress(codec, data)
    truncated = packed[:max(0, len(packed) - cut)]
    try:
        out = decompress(truncated, _flag(codec), 1 << 20)
    except BodyDecodeError:
        return
    assert out == data  # a cut that removed only an optional trailer may still read back whole


@given(st.binary(max_size=2000), st.sampled_from([ZLIB_LEGACY, LZ4, ZSTD, ZLIB, 4, 5, 6, 7]))
@settings(max_examples=300, deadline=None)
def test_arbitrary_bytes_decode_or_raise_a_decode_error(data: bytes, codec: int) -> None:
    try:
        out = decompress(data, _flag(codec), 1 << 16)
    except BodyDecodeError:
        return
    assert len(out) <= 1 << 16
