"""The ingest log: one frame per group commit, so a batch spanning many segments costs one write
and, with `flush="sync"`, one fsync, whatever the number of segments it touches.

Frames are replayed into the part files on recovery from the last checkpoint; older log files are
deleted once a checkpoint has made the parts durable on their own.

    frame header (24 bytes): magic uint32 (0x32495754, "TWI2"), count uint32, payload_len uint32,
                             crc uint32, written_ms int64
    payload:                 count location rows (LOCATION_DTYPE, 32 bytes each), then the
                             count encoded records back to back

The CRC32C covers every other byte of the frame: the header's magic, count, payload_len and
written_ms (in that order), then the payload. Frames of the first version (magic 0x4C495754,
"TWIL", CRC of the payload only) are still read, with their count checked against the payload's
layout, so a log written before the upgrade replays.

A frame that fails its checks in the middle of a file is skipped: replay resyncs on the next valid
frame (the next magic whose frame checks out) and notes where it skipped (`skipped`), so one bad
frame never hides the acknowledged frames after it. Bytes after a file's last valid frame are a
torn tail.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from storage._files import fsync_path
from storage.errors import SnapshotMovedError
from storage.record import crc32c

FRAME_MAGIC = 0x32495754  # "TWI2": the CRC covers the header too
FRAME_MAGIC_V1 = 0x4C495754  # "TWIL": the CRC covers the payload only; read, never written
FRAME_HEADER = struct.Struct("<IIIIq")
_CRC_AT = struct.calcsize("<III")  # the crc field; the CRC covers the bytes before and after it
_CRC_END = struct.calcsize("<IIII")
LOCATION_DTYPE = np.dtype([("segment_ms", "<i8"), ("due_ms", "<i8"), ("offset", "<u4"), ("length", "<u4"),
                           ("part", "<u2"), ("reserved", "<u2"), ("reserved2", "<u4")])
_SUFFIX = ".wal"


def _file_name(seq: int) -> str:
    return f"{seq:012d}{_SUFFIX}"


@dataclass(frozen=True, slots=True)
class IngestFrame:
    """One replayed frame: where each record goes, and the record bytes."""

    seq: int
    end: int
    locations: np.ndarray
    records: memoryview


def frame_crc(header: bytes | bytearray | memoryview, payload: bytes | memoryview) -> int:
    """CRC32C of a frame: its header without the crc field, then its payload."""
    return crc32c(payload, crc32c(header[_CRC_END:FRAME_HEADER.size], crc32c(header[:_CRC_AT])))


class IngestLog:
    """Append-only frames in numbered files under one directory."""

    def __init__(self, directory: str | os.PathLike[str], *, sync_dir: bool = False, create: bool = True) -> None:
        """Frames in `directory` (made when `create`); with `sync_dir`, a new file's name is made
        durable before any frame is written to it (flush="sync" acknowledges a frame once it is fsynced)."""
        self.dir = Path(directory)
        if create:
            self.dir.mkdir(parents=True, exist_ok=True)
        self.sync_dir = sync_dir
        self._fd: int | None = None
        self.seq = -1
        self.position = 0
        #: (file number, position, bytes) of each run of bad bytes `frames` skipped to reach a valid frame
        self.skipped: list[tuple[int, int, int]] = []

    def sequences(self) -> list[int]:
        """Numbers of the log files present, oldest first."""
        return sorted(int(p.stem) for p in self.dir.glob("*" + _SUFFIX) if p.stem.isdigit())

    def open_new(self, seq: int) -> None:
        """Start appending to a fresh file number `seq`."""
        self.close()
        self._fd = os.open(self.dir / _file_name(seq), os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_APPEND, 0o644)
        if self.sync_dir:
            fsync_path(self.dir)
        self.seq = seq
        self.position = 0

    def append(self, locations: np.ndarray, records: list[bytes], written_ms: int, sync: bool) -> None:
        """Write one frame with a single write; fsync it when `sync`."""
        if self._fd is None:
            raise RuntimeError("ingest log is not open")
        payload = b"".join([np.ascontiguousarray(locations, LOCATION_DTYPE).tobytes(), *records])
        header = bytearray(FRAME_HEADER.pack(FRAME_MAGIC, len(records), len(payload), 0, written_ms))
        struct.pack_into("<I", header, _CRC_AT, frame_crc(header, payload))
        frame = bytes(header) + payload
        view = memoryview(frame)
        while view:
            n = os.write(self._fd, view)
            view = view[n:]
        if sync:
            os.fdatasync(self._fd)
        self.position += len(frame)

    def truncate(self, seq: int, position: int) -> None:
        """Cut the current file back to `position` (after a failed append)."""
        if self._fd is not None and seq == self.seq:
            os.ftruncate(self._fd, position)
            self.position = position

    def sync(self) -> None:
        """fsync the current file."""
        if self._fd is not None:
            os.fdatasync(self._fd)

    def frames(self, from_seq: int, from_pos: int) -> Iterator[IngestFrame]:
        """Frames from (from_seq, from_pos) on; a bad frame is skipped to the next valid one (noted
        in `skipped`), and the bytes after a file's last valid frame end its frames."""
        for seq in self.sequences():
            if seq < from_seq:
                continue
            data = (self.dir / _file_name(seq)).read_bytes()
            pos = from_pos if seq == from_seq else 0
            mv = memoryview(data)
            while pos + FRAME_HEADER.size <= len(data):
                frame = _frame_at(data, mv, seq, pos)
                if frame is None:
                    nxt = _next_valid(data, mv, seq, pos + 1)
                    if nxt < 0:
                        break  # a torn tail
                    self.skipped.append((seq, pos, nxt - pos))
                    pos = nxt
                    continue
                yield frame
                pos = frame.end

    def valid_length(self, seq: int) -> int:
        """Bytes of file `seq` that hold whole, valid frames."""
        end = 0
        for frame in self.frames(seq, 0):
            if frame.seq != seq:
                break
            end = frame.end
        return end

    def remove_before(self, seq: int) -> None:
        """Delete files older than `seq` (their frames are durable in the parts)."""
        for s in self.sequences():
            if s < seq:
                (self.dir / _file_name(s)).unlink(missing_ok=True)

    def close(self) -> None:
        """Close the current file."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


_MAGICS = (struct.pack("<I", FRAME_MAGIC), struct.pack("<I", FRAME_MAGIC_V1))


def _frame_at(data: bytes, mv: memoryview, seq: int, pos: int) -> IngestFrame | None:
    """The valid frame at `pos` of file `seq`, or None."""
    if pos + FRAME_HEADER.size > len(data):
        return None
    magic, count, plen, crc, _written = FRAME_HEADER.unpack_from(data, pos)
    end = pos + FRAME_HEADER.size + plen
    if magic not in (FRAME_MAGIC, FRAME_MAGIC_V1) or end > len(data):
        return None
    payload = mv[pos + FRAME_HEADER.size:end]
    header = mv[pos:pos + FRAME_HEADER.size]
    if (frame_crc(header, payload) if magic == FRAME_MAGIC else crc32c(payload)) != crc:
        return None
    loc_bytes = count * LOCATION_DTYPE.itemsize
    if loc_bytes > plen:
        return None  # a first-version frame whose count its CRC did not cover
    locs = np.frombuffer(payload[:loc_bytes], dtype=LOCATION_DTYPE)
    if int(locs["length"].sum(dtype=np.int64)) != plen - loc_bytes:
        return None
    return IngestFrame(seq, end, locs, payload[loc_bytes:])


def _next_valid(data: bytes, mv: memoryview, seq: int, start: int) -> int:
    """Where the next valid frame at or after `start` begins, or -1."""
    while True:
        found = [p for p in (data.find(m, start) for m in _MAGICS) if p >= 0]
        if not found:
            return -1
        pos = min(found)
        if _frame_at(data, mv, seq, pos) is not None:
            return pos
        start = pos + 1


def records_holding(directory: str | os.PathLike[str], from_seq: int, from_pos: int,
                    needles: Sequence[bytes]) -> list[tuple[np.void, bytes]]:
    """Records of the frames since (from_seq, from_pos) whose bytes hold one of `needles`, each with
    its location row: what a reader beside the engine cannot find in the meta store yet (its
    entries are flushed at checkpoints). The caller decodes each and checks what it holds."""
    if not Path(directory).is_dir():
        return []
    log = IngestLog(directory, create=False)
    try:
        return _holding(log.frames(from_seq, from_pos), needles)
    except FileNotFoundError as e:  # a checkpoint flushed those frames and removed their file meanwhile
        raise SnapshotMovedError(f"the engine checkpointed while its ingest log was read ({e.filename} was "
                                 "removed): its records are in the meta store now") from e


def _holding(frames: Iterator[IngestFrame], needles: Sequence[bytes]) -> list[tuple[np.void, bytes]]:
    found: list[tuple[np.void, bytes]] = []
    for frame in frames:
        data = bytes(frame.records)
        if not any(n in data for n in needles):
            continue
        ends = np.cumsum(frame.locations["length"].astype(np.int64))
        hits: set[int] = set()
        for needle in needles:
            at = data.find(needle)
            while at >= 0:
                hits.add(int(np.searchsorted(ends, at, side="right")))
                at = data.find(needle, at + 1)
        for i in sorted(hits):
            start = int(ends[i - 1]) if i else 0
            found.append((frame.locations[i], data[start:int(ends[i])]))
    return found
