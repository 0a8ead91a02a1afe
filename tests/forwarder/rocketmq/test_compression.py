"""Compressed bodies as every RocketMQ producer writes them are read back, under the size bound."""
from __future__ import annotations

import zlib
from typing import Any

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


def test_checking_many_zstd_frames_reads_each_byte_a_bounded_number_of_times(monkeypatch: pytest.MonkeyPatch) -> None:
    # 40,000 empty frames: the check for a cut frame once handed every frame's remainder to a new
    # decompressor (quadratic: 4 MB of them cost 24 s of CPU per message)
    empty = zstandard.ZstdCompressor().compress(b"")
    body = empty * 40_000
    handed = [0]
    real = zstandard.ZstdDecompressor

    class Counting:
        def __init__(self, *a: Any, **kw: Any) -> None:
            self._d = real(*a, **kw)

        def stream_reader(self, source: Any, **kw: Any) -> object:
            if hasattr(source, "getbuffer"):
                handed[0] += len(source.getbuffer())
            return self._d.stream_reader(source, **kw)

        def decompressobj(self, *a: Any, **kw: Any) -> object:
            inner = self._d.decompressobj(*a, **kw)

            class Obj:
                def decompress(self, data: bytes) -> bytes:
                    handed[0] += len(data)
                    return inner.decompress(data)

                def __getattr__(self, name: str) -> object:
                    return getattr(inner, name)
            return Obj()

    monkeypatch.setattr(zstandard, "ZstdDecompressor", Counting)
    assert decompress(body, _flag(ZSTD), 1 << 20) == b""
    assert handed[0] <= 2 * len(body)


@pytest.mark.parametrize("tail", [pytest.param(b"\x00" * 5, id="garbage"),
                                  pytest.param(b"\x28\xb5\x2f\xfd", id="a-bare-magic")])
def test_zstd_bytes_after_the_last_frame_are_refused(tail: bytes) -> None:
    body = zstandard.ZstdCompressor(write_checksum=True).compress(b"hello" * 100) + tail
    with pytest.raises(BodyDecodeError):
        decompress(body, _flag(ZSTD), 1 << 20)


def test_zstd_skippable_frames_and_several_frames_read_back() -> None:
    c = zstandard.ZstdCompressor(write_checksum=True)
    skippable = b"\x50\x2a\x4d\x18" + (3).to_bytes(4, "little") + b"abc"
    body = c.compress(b"one") + skippable + c.compress(b"two" * 1000)
    assert decompress(body, _flag(ZSTD), 1 << 20) == b"one" + b"two" * 1000
