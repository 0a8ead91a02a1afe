"""The tombstone log: cancels that must outlive a restart, so a cancel that arrives before the
message it names still wins when that message comes.

One file, `<data_dir>/cancels/tombstones.log`, of frames appended one per batch of cancels:

    frame header (24 bytes): magic uint32 (0x31435754, "TWC1"), count uint32, payload_len uint32,
                             crc uint32, written_ms int64
    payload:                 count entries, each an entry header then its text
    entry header (24 bytes): kind uint8 (1 id, 2 key), reserved uint8 (0), text_len uint16,
                             reserved uint32 (0), born_ms int64, expires_ms int64
    text:                    text_len bytes of UTF-8: the message id or the business key

The CRC32C covers every other byte of the frame: magic, count, payload_len and written_ms (in that
order), then the payload. `born_ms` is when the cancel was sent (its producer's clock), `expires_ms`
when the engine may forget it. Reading skips a frame that fails its checks, reports it, and resyncs
on the next valid frame, so one bad frame never hides the cancels after it. Only a torn tail is cut
before the next append: fewer bytes than a header, or a header whose frame runs past the end of the
file (a crash mid-append). A whole frame that fails its checks is damage: it is counted, reported
and left in place, never cut silently. A frame's payload is written at most `MAX_WRITE_PAYLOAD`
bytes (a batch or a compaction is split into as many frames as it needs); the reader takes any
length a frame's CRC vouches for, so a file written before that bound reads back whole. `rewrite`
compacts the file (the live tombstones only) through a temporary file renamed into place.

Durability: with `sync` every append is fsynced before it returns; in every mode `flush()` (the
engine's checkpoint) and `close()` fsync what was appended, so the loss window is one checkpoint; and
the directory is fsynced when the file is created, in every mode (a power loss could otherwise take
the file's name, and every tombstone in it, however often the file was fsynced).
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from storage._files import fsync_path, write_all
from storage.errors import InvalidRecordError
from storage.record import crc32c

FRAME_MAGIC = 0x31435754  # "TWC1"
FRAME_HEADER = struct.Struct("<IIIIq")
ENTRY_HEADER = struct.Struct("<BBHIqq")
_CRC_AT = struct.calcsize("<III")  # the crc field; the CRC covers the bytes before and after it
_CRC_END = struct.calcsize("<IIII")
_MAGIC_BYTES = struct.pack("<I", FRAME_MAGIC)
#: what a tombstone names
ID, KEY = 1, 2
KINDS = (ID, KEY)
MAX_TEXT = 0xFFFF  # text_len is uint16
#: the most payload one written frame holds: larger batches and compactions take several frames
MAX_WRITE_PAYLOAD = 1 << 20
LOG_NAME = Path("cancels") / "tombstones.log"


@dataclass(frozen=True, slots=True)
class Tombstone:
    """A cancel kept on disk: what it names (an id or a key), when it was sent, when it expires."""

    kind: int
    text: str
    born_ms: int
    expires_ms: int


@dataclass(slots=True)
class TombstoneRead:
    """What reading the log found: the tombstones in order, bad frames skipped, where the valid bytes end."""

    tombstones: list[Tombstone] = field(default_factory=list)
    corrupt_frames: int = 0
    valid_end: int = 0
    size: int = 0
    #: where a torn tail begins (the file's size when there is none): what `read` cuts
    torn_from: int = 0


def tombstone_log(data_dir: str | os.PathLike[str]) -> Path:
    """Where a data directory keeps its tombstones."""
    return Path(data_dir) / LOG_NAME


def encode_frame(tombstones: Sequence[Tombstone], written_ms: int) -> bytes:
    """One frame holding `tombstones`; InvalidRecordError for a kind, text or time the layout cannot hold."""
    parts: list[bytes] = []
    for t in tombstones:
        if t.kind not in KINDS:
            raise InvalidRecordError(f"tombstone kind {t.kind} is neither {ID} (id) nor {KEY} (key)")
        text = t.text.encode("utf-8")
        if not text or len(text) > MAX_TEXT:
            raise InvalidRecordError(f"a tombstone's text must be 1..{MAX_TEXT} bytes of UTF-8, not {len(text)}")
        try:
            parts.append(ENTRY_HEADER.pack(t.kind, 0, len(text), 0, t.born_ms, t.expires_ms))
        except struct.error as e:
            raise InvalidRecordError(f"tombstone times must fit int64: {e}") from e
        parts.append(text)
    payload = b"".join(parts)
    head = bytearray(FRAME_HEADER.pack(FRAME_MAGIC, len(tombstones), len(payload), 0, written_ms))
    struct.pack_into("<I", head, _CRC_AT, _frame_crc(head, payload))
    return bytes(head) + payload


def encode_frames(tombstones: Sequence[Tombstone], written_ms: int) -> list[bytes]:
    """`tombstones` as frames of at most `MAX_WRITE_PAYLOAD` payload bytes each, in order."""
    frames: list[bytes] = []
    batch: list[Tombstone] = []
    size = 0
    for t in tombstones:
        n = ENTRY_HEADER.size + len(t.text.encode("utf-8"))
        if batch and size + n > MAX_WRITE_PAYLOAD:
            frames.append(encode_frame(batch, written_ms))
            batch, size = [], 0
        batch.append(t)
        size += n
    if batch:
        frames.append(encode_frame(batch, written_ms))
    return frames


def _frame_crc(header: bytes | bytearray | memoryview, payload: bytes | memoryview) -> int:
    return crc32c(payload, crc32c(header[_CRC_END:FRAME_HEADER.size], crc32c(header[:_CRC_AT])))


def _decode_payload(payload: memoryview, count: int) -> list[Tombstone] | None:
    """The entries of a CRC-checked payload, or None when they do not fill it exactly."""
    out: list[Tombstone] = []
    pos = 0
    for _ in range(count):
        if pos + ENTRY_HEADER.size > len(payload):
            return None
        kind, r1, n, r2, born, expires = ENTRY_HEADER.unpack_from(payload, pos)
        pos += ENTRY_HEADER.size
        if kind not in KINDS or r1 or r2 or not n or pos + n > len(payload):
            return None
        try:
            text = bytes(payload[pos:pos + n]).decode("utf-8")
        except UnicodeDecodeError:
            return None
        pos += n
        out.append(Tombstone(kind, text, born, expires))
    return out if pos == len(payload) else None


def decode_frames(data: bytes | memoryview) -> TombstoneRead:
    """Every valid frame's tombstones, resyncing past bad frames (counted); a torn tail is marked."""
    view = memoryview(data)
    raw = data if isinstance(data, bytes) else bytes(view)  # searched for magics without a copy each
    out = TombstoneRead(size=len(view), torn_from=len(view))
    pos = 0
    while pos < len(view):
        entries = _frame_at(view, pos)
        if entries is not None:
            out.tombstones.extend(entries[0])
            pos = out.valid_end = entries[1]
            continue
        whole = _whole_header_at(view, pos)
        # not a valid frame here: the next one that is valid starts at a later magic, if any
        nxt = pos + 1
        while (nxt := raw.find(_MAGIC_BYTES, nxt)) >= 0 and _frame_at(view, nxt) is None:
            nxt += 1
        if nxt < 0:
            if whole:
                out.corrupt_frames += 1  # a whole frame that fails its checks: damage, kept in place
            else:
                out.torn_from = pos  # a crash mid-append (or bytes that are no frame): a torn tail
            break
        out.corrupt_frames += 1
        pos = nxt
    return out


def _whole_header_at(view: memoryview, pos: int) -> bool:
    """Whether a header with the magic starts at `pos` and its frame ends inside the file."""
    if pos + FRAME_HEADER.size > len(view):
        return False
    magic, _, length, _, _ = FRAME_HEADER.unpack_from(view, pos)
    return magic == FRAME_MAGIC and pos + FRAME_HEADER.size + length <= len(view)


def _frame_at(view: memoryview, pos: int) -> tuple[list[Tombstone], int] | None:
    """The tombstones of the valid frame at `pos` and where it ends, or None."""
    if not _whole_header_at(view, pos):
        return None
    _, count, length, crc, _ = FRAME_HEADER.unpack_from(view, pos)
    end = pos + FRAME_HEADER.size + length
    payload = view[pos + FRAME_HEADER.size:end]
    if _frame_crc(view[pos:pos + FRAME_HEADER.size], payload) != crc:
        return None
    entries = _decode_payload(payload, count)
    return None if entries is None else (entries, end)


class TombstoneLog:
    """The append-only tombstone file of one data directory; one writer (the engine) at a time."""

    def __init__(self, data_dir: str | os.PathLike[str], *, sync: bool = False) -> None:
        """Open (creating) the log; `sync`: fsync every append before it returns."""
        self.path = tombstone_log(data_dir)
        self.sync = sync
        created = not self.path.parent.exists()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if created:
            fsync_path(self.path.parent.parent)
        self._fd: int | None = None

    def read(self) -> TombstoneRead:
        """Every tombstone on disk; a torn tail (bytes after the last valid frame) is cut."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return TombstoneRead()
        found = decode_frames(data)
        if found.torn_from < found.size:
            with open(self.path, "r+b") as f:
                f.truncate(found.torn_from)
                os.fsync(f.fileno())
        return found

    def append(self, tombstones: Sequence[Tombstone], now_ms: int) -> None:
        """Add tombstones as one frame (fsynced before returning when `sync`)."""
        if not tombstones:
            return
        frame = b"".join(encode_frames(tombstones, now_ms))
        if self._fd is None:
            new = not self.path.exists()
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            if new:  # in every mode: the file's fsyncs (`flush`, `close`) keep nothing if its name is lost
                fsync_path(self.path.parent)
        write_all(self._fd, frame)
        if self.sync:
            os.fsync(self._fd)

    def rewrite(self, tombstones: Iterable[Tombstone], now_ms: int) -> None:
        """Replace the file by one holding only `tombstones` (compaction): the new file is written
        and fsynced under a temporary name, then renamed over the old one, whose directory is fsynced."""
        self.close()
        tmp = self.path.with_suffix(".tmp")
        live = list(tombstones)
        with open(tmp, "wb") as f:
            for frame in encode_frames(live, now_ms):
                f.write(frame)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fsync_path(self.path.parent)

    def flush(self) -> None:
        """fsync what was appended (in every mode: the engine calls it at each checkpoint)."""
        if self._fd is not None:
            os.fsync(self._fd)

    def close(self) -> None:
        """fsync and close the file (an append opens it again)."""
        if self._fd is not None:
            try:
                os.fsync(self._fd)
            finally:
                os.close(self._fd)
                self._fd = None
