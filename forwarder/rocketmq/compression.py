"""Message bodies as producers compress them, read back under a size bound.

A stored message's system flag says whether its body is compressed (bit 0x1) and with which codec
(bits 8-10). Clients before 4.9.4 wrote zlib with the codec bits clear; Java clients since then
write zlib as type 3, and LZ4 (type 1, LZ4 frame format) or ZSTD (type 2, zstd frames) when the
producer asks (`setCompressType`, `-Drocketmq.message.compressType`). Java producers compress every
body of 4 KiB or more by default.

Decompression stops at `limit` bytes while it runs: a small body that would inflate to gigabytes
raises BodyTooLargeError after reading `limit + 1` bytes, never more. Across the messages of one
ingest commit, an `InflateBudget` bounds the sum: a message that would take the commit past it is
left for the next commit (the first message of a commit always goes, under its own `limit`), so a
commit inflates at most its budget plus one message. Checking that a zstd body is whole walks its
frame and block headers once: linear in the body, whatever the number of frames.
"""
from __future__ import annotations

import io
import zlib
from dataclasses import dataclass

from forwarder.errors import ForwarderError

COMPRESSED = 0x1
CODEC_MASK = 0x700
CODEC_SHIFT = 8
#: codec numbers in the system flag, as RocketMQ's CompressionType defines them
ZLIB_LEGACY, LZ4, ZSTD, ZLIB = 0, 1, 2, 3
CODEC_NAMES = {ZLIB_LEGACY: "zlib", LZ4: "lz4", ZSTD: "zstd", ZLIB: "zlib"}


class BodyDecodeError(ForwarderError):
    """A body that cannot be read back: unknown codec or corrupt compressed bytes."""


class BodyTooLargeError(BodyDecodeError):
    """A compressed body that inflates past the size limit."""


@dataclass(slots=True)
class InflateBudget:
    """Inflated bytes one ingest commit may still take across its messages."""

    remaining: int
    #: messages inflated under this budget so far (the first one always goes)
    taken: int = 0
    #: set when reading stopped before a message that would have gone past the budget
    stopped: bool = False

    def limit(self, max_body_bytes: int) -> int:
        """How many bytes the next message may inflate to here."""
        return max_body_bytes if self.taken == 0 else max(0, min(max_body_bytes, self.remaining))

    def spend(self, n: int) -> None:
        """Count a message that inflated to `n` bytes."""
        self.taken += 1
        self.remaining -= n


def codec_of(sys_flag: int) -> int | None:
    """The codec number of a compressed body, or None if the body is stored as sent."""
    return (sys_flag & CODEC_MASK) >> CODEC_SHIFT if sys_flag & COMPRESSED else None


def decompress(body: bytes, sys_flag: int, limit: int) -> bytes:
    """The body as the producer sent it, at most `limit` bytes; raises BodyDecodeError/BodyTooLargeError."""
    codec = codec_of(sys_flag)
    if codec is None:
        return body
    if not body:  # every codec writes a header, even for an empty body
        raise BodyDecodeError(f"the system flag {sys_flag:#x} says compressed but the body is empty")
    try:
        if codec in (ZLIB, ZLIB_LEGACY):
            out = _zlib(body, limit)
        elif codec == LZ4:
            out = _lz4(body, limit)
        elif codec == ZSTD:
            out = _zstd(body, limit)
        else:
            raise BodyDecodeError(f"compression type {codec} in the system flag {sys_flag:#x} is unknown "
                                  f"(RocketMQ defines 1 LZ4, 2 ZSTD, 3 ZLIB)")
    except BodyDecodeError:
        raise
    except Exception as e:  # each library has its own error types for corrupt input
        raise BodyDecodeError(f"{CODEC_NAMES.get(codec, codec)} body of {len(body)} bytes is corrupt: {e}") from e
    if len(out) > limit:
        raise BodyTooLargeError(f"{CODEC_NAMES[codec]} body of {len(body)} bytes inflates past the limit of "
                                f"{limit} bytes (it exceeds the maximum body size)")
    return out


def _zlib(body: bytes, limit: int) -> bytes:
    d = zlib.decompressobj()
    out = d.decompress(body, limit + 1)
    if len(out) <= limit and not d.eof:
        raise BodyDecodeError(f"zlib body of {len(body)} bytes is truncated")
    return out


def _lz4(body: bytes, limit: int) -> bytes:
    import lz4.frame  # imported on first use: most deployments never see an LZ4 body

    d = lz4.frame.LZ4FrameDecompressor()
    out = bytes(d.decompress(body, max_length=limit + 1))
    if len(out) <= limit and not d.eof:
        raise BodyDecodeError(f"lz4 body of {len(body)} bytes is truncated")
    return out


def _zstd(body: bytes, limit: int) -> bytes:
    import zstandard  # imported on first use, as lz4

    dctx = zstandard.ZstdDecompressor()
    with dctx.stream_reader(io.BytesIO(body), read_across_frames=True) as r:
        out = bytes(r.read(limit + 1))
    if len(out) > limit:
        return out
    # The reader ends quietly at a cut frame: check that every frame is whole, walking the frame
    # and block headers once (linear in the body; nothing is decompressed a second time).
    _check_zstd_frames(body)
    return out


_ZSTD_MAGIC = 0xFD2FB528
_SKIPPABLE_MASK, _SKIPPABLE = 0xFFFFFFF0, 0x184D2A50
_ZSTD_MAX_HEADER = 18  # magic, descriptor, window, dictionary id, content size: at most 18 bytes
_RLE, _RESERVED = 1, 3  # block types: 0 raw, 1 RLE (one byte stored), 2 compressed, 3 reserved


def _check_zstd_frames(body: bytes) -> None:
    """Raise BodyDecodeError unless `body` is whole zstd frames (skippable ones allowed), end to end."""
    import zstandard

    mv, n, pos = memoryview(body), len(body), 0

    def need(end: int) -> None:
        if end > n:
            raise BodyDecodeError(f"zstd body of {n} bytes is truncated")

    while pos < n:
        need(pos + 4)
        magic = int.from_bytes(mv[pos:pos + 4], "little")
        if magic & _SKIPPABLE_MASK == _SKIPPABLE:
            need(pos + 8)
            pos += 8 + int.from_bytes(mv[pos + 4:pos + 8], "little")
            need(pos)
            continue
        if magic != _ZSTD_MAGIC:
            raise BodyDecodeError(f"zstd body of {n} bytes is corrupt: no frame starts at byte {pos}")
        head = bytes(mv[pos:pos + _ZSTD_MAX_HEADER])
        try:
            pos += zstandard.frame_header_size(head)
            checksum = zstandard.get_frame_parameters(head).has_checksum
        except zstandard.ZstdError as e:
            raise BodyDecodeError(f"zstd body of {n} bytes is truncated or corrupt: {e}") from e
        last = False
        while not last:
            need(pos + 3)
            block = int.from_bytes(mv[pos:pos + 3], "little")
            last, kind, size = bool(block & 1), (block >> 1) & 3, block >> 3
            if kind == _RESERVED:
                raise BodyDecodeError(f"zstd body of {n} bytes is corrupt: a block of the reserved type")
            pos += 3 + (1 if kind == _RLE else size)
            need(pos)
        pos += 4 if checksum else 0
        need(pos)


__all__ = ["BodyDecodeError", "BodyTooLargeError", "CODEC_NAMES", "COMPRESSED", "InflateBudget", "LZ4", "ZLIB",
           "ZLIB_LEGACY", "ZSTD", "codec_of", "decompress"]
