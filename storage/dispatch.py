"""The per-segment dispatch log: what happened to each record, in fixed-width 24-byte rows.

The file is a sequence of frames; a frame is one header row followed by its entries.

    header row:  magic uint32, count uint32, crc uint32, note_len uint32 (0 before "TWD3"),
                 written_ms int64
    entry row:   due_ms int64, dispatch_ms int64, offset uint32, part uint16, outcome uint8,
                 attempts uint8
    answer row:  queue_offset int64, commit_offset int64, store_ip 4 bytes (network order),
                 store_port uint16, queue_id uint16                       ("TWD3" frames only)

Frame versions, by magic:
- "TWD3" (0x33445754, written when a frame carries the broker's answers or a note): `count`
  entries of two rows each (the entry row, then its answer row: where the broker stored the
  delivered message, the parts of its message id), then `note_len` bytes of UTF-8 (why: a send's
  error, a dead letter's reason) padded with zeros to whole rows;
- "TWD2" (0x32445754, written otherwise): `count` entry rows;
- "TWDP" (0x50445754, first version, read only): as TWD2, its CRC over the entry rows only.

A TWD2/TWD3 frame's CRC32C covers every other byte of it: the header's magic and count, its
note_len and written_ms fields, then every row after the header. A frame that fails its checks is
skipped and counted, and reading resyncs on the next row that starts a valid frame (rows are fixed
width), so one bad frame never hides the frames after it; bytes after the last valid frame are a
torn tail.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field

import numpy as np

from storage.record import crc32c

DISPATCH_DTYPE = np.dtype([("due_ms", "<i8"), ("dispatch_ms", "<i8"), ("offset", "<u4"), ("part", "<u2"),
                           ("outcome", "u1"), ("attempts", "u1")])
#: the broker's answer for a delivered message: its queue offset on the target topic and its message id
#: (store host and commit-log offset: `broker_message_id`); queue_offset -1 means none was recorded
ANSWER_DTYPE = np.dtype([("queue_offset", "<i8"), ("commit_offset", "<i8"), ("store_ip", "u1", (4,)),
                         ("store_port", "<u2"), ("queue_id", "<u2")])
#: a TWD3 entry: the entry row's fields, then the answer row's
_ANSWERED_DTYPE = np.dtype(DISPATCH_DTYPE.descr + ANSWER_DTYPE.descr)
_HEADER_DTYPE = np.dtype([("magic", "<u4"), ("count", "<u4"), ("crc", "<u4"), ("note_len", "<u4"),
                          ("written_ms", "<i8")])
_HEADER = struct.Struct("<IIIIq")
ROW_SIZE = DISPATCH_DTYPE.itemsize
assert _HEADER_DTYPE.itemsize == ROW_SIZE == ANSWER_DTYPE.itemsize == _HEADER.size
assert _ANSWERED_DTYPE.itemsize == 2 * ROW_SIZE
FRAME_MAGIC_V3 = 0x33445754  # "TWD3": entries with the broker's answers, and a note
FRAME_MAGIC = 0x32445754  # "TWD2": the CRC covers the header too
FRAME_MAGIC_V1 = 0x50445754  # "TWDP": the CRC covers the entry rows only; read, never written
_MAGICS = (FRAME_MAGIC_V3, FRAME_MAGIC, FRAME_MAGIC_V1)
_CRC_AT = _HEADER_DTYPE["magic"].itemsize + _HEADER_DTYPE["count"].itemsize  # the crc field follows them
_CRC_END = _CRC_AT + _HEADER_DTYPE["crc"].itemsize
MAX_NOTE = 4096  # bytes of a frame's note; a longer one is cut

DELIVERED = 1
DEAD_LETTERED = 2
CANCELLED = 3
REPLAYED = 4
CORRUPT = 5
RETRIED = 6
OUTCOME_NAMES = {DELIVERED: "delivered", DEAD_LETTERED: "dead_lettered", CANCELLED: "cancelled",
                 REPLAYED: "replayed", CORRUPT: "corrupt", RETRIED: "retried"}
TERMINAL = (DELIVERED, DEAD_LETTERED, CANCELLED, CORRUPT)  # a record with one of these is done


def dispatch_entries(part: np.ndarray | int, offset: np.ndarray, due_ms: np.ndarray, dispatch_ms: np.ndarray | int,
                     outcome: int, attempts: np.ndarray | int = 1) -> np.ndarray:
    """Build dispatch entries from columns (scalars broadcast)."""
    out = np.empty(len(offset), DISPATCH_DTYPE)
    out["part"] = part
    out["offset"] = offset
    out["due_ms"] = due_ms
    out["dispatch_ms"] = dispatch_ms
    out["outcome"] = outcome
    out["attempts"] = np.minimum(attempts, 255)
    return out


def no_answers(n: int) -> np.ndarray:
    """`n` answers that say nothing (queue_offset -1)."""
    out = np.zeros(n, ANSWER_DTYPE)
    out["queue_offset"] = -1
    return out


def broker_message_id(answer: np.void) -> str | None:
    """The broker's message id of one answer (what `mqadmin queryMsgById` takes: store host IPv4,
    port and commit-log offset as 32 hex digits), or None when none was recorded."""
    if int(answer["queue_offset"]) < 0 or not any(answer["store_ip"]):
        return None
    return (bytes(answer["store_ip"]) + struct.pack(">IQ", int(answer["store_port"]),
                                                     int(answer["commit_offset"]))).hex().upper()


_MSG_ID = np.dtype([("ip", "u1", (4,)), ("port", ">u4"), ("offset", ">i8")])  # a broker message id's bytes


def broker_message_ids(answers: np.ndarray) -> list[str]:
    """`broker_message_id` of every answer at once ("" where none was recorded)."""
    n = len(answers)
    raw = np.empty(n, _MSG_ID)
    raw["ip"] = answers["store_ip"]
    raw["port"] = answers["store_port"]
    raw["offset"] = answers["commit_offset"]
    text = raw.tobytes().hex().upper()
    width = 2 * _MSG_ID.itemsize
    known = (answers["queue_offset"] >= 0) & answers["store_ip"].any(axis=1)
    return [text[i * width:(i + 1) * width] if ok else "" for i, ok in enumerate(known.tolist())]


def encode_frame(entries: np.ndarray, written_ms: int, answers: np.ndarray | None = None, note: str = "") -> bytes:
    """One frame: a header row and the entries; with `answers` (ANSWER_DTYPE, aligned) or a `note`,
    a TWD3 frame that keeps them."""
    if answers is None and not note:
        magic, note_len = FRAME_MAGIC, 0
        body = np.ascontiguousarray(entries, dtype=DISPATCH_DTYPE).tobytes()
    else:
        given = no_answers(len(entries)) if answers is None else answers
        if len(given) != len(entries):
            raise ValueError(f"{len(given)} answers for {len(entries)} entries")
        if len(entries) == 1:  # a send of one message: its two rows as they are, no array to interleave them
            rows = (np.ascontiguousarray(entries, DISPATCH_DTYPE).tobytes()
                    + np.ascontiguousarray(given, ANSWER_DTYPE).tobytes())
        else:
            both = np.empty((len(entries), 2 * ROW_SIZE), np.uint8)  # each entry row, then its answer row
            both[:, :ROW_SIZE] = np.ascontiguousarray(entries, DISPATCH_DTYPE).view(np.uint8).reshape(-1, ROW_SIZE)
            both[:, ROW_SIZE:] = np.ascontiguousarray(given, ANSWER_DTYPE).view(np.uint8).reshape(-1, ROW_SIZE)
            rows = both.tobytes()
        text = note.encode("utf-8", "replace")[:MAX_NOTE]
        magic, note_len = FRAME_MAGIC_V3, len(text)
        body = rows + text + b"\x00" * (-len(text) % ROW_SIZE)
    count = len(entries)
    # the header row (`_HEADER_DTYPE`) packed, not an array: one frame per send
    crc = frame_crc(_HEADER.pack(magic, count, 0, note_len, written_ms), body)
    return _HEADER.pack(magic, count, crc, note_len, written_ms) + body


def frame_crc(header: bytes, body: bytes | memoryview) -> int:
    """CRC32C of a frame: its header row without the crc field, then its rows after the header."""
    return crc32c(body, crc32c(header[_CRC_END:ROW_SIZE], crc32c(header[:_CRC_AT])))


@dataclass(frozen=True, slots=True)
class DispatchLogRead:
    """A dispatch log as read: the valid entries, and what was found wrong.

    `answers` (ANSWER_DTYPE) and `note` (an index into `notes`, -1 for none) are aligned with
    `entries`; entries of frames without answers have queue_offset -1."""

    entries: np.ndarray
    valid_bytes: int
    corrupt_frames: int
    torn_bytes: int
    answers: np.ndarray = field(default_factory=lambda: no_answers(0))
    note: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    notes: list[str] = field(default_factory=list)


def read_dispatch_log(path: str | os.PathLike[str]) -> DispatchLogRead:
    """Read every valid frame; skips (and counts) bad frames, resyncing on the next valid one."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return DispatchLogRead(np.empty(0, DISPATCH_DTYPE), 0, 0, 0)
    n_rows = len(raw) // ROW_SIZE
    view = memoryview(raw)
    starts: np.ndarray | None = None  # rows that may start a frame, found at the first bad one
    plain: list[tuple[int, int]] = []  # (first entry row, count) of frames without answers
    answered: list[tuple[int, int, int]] = []  # (first entry row, count, note index) of TWD3 frames
    order: list[tuple[bool, int]] = []  # frames in file order: (answered?, index in its list)
    notes: list[str] = []
    row = end = corrupt = 0
    while row < n_rows:
        found = _frame_at(view, row, n_rows)
        if found is not None:
            magic, count, rows, note = found
            if magic == FRAME_MAGIC_V3:
                note_at = -1
                if note:
                    notes.append(note)
                    note_at = len(notes) - 1
                order.append((True, len(answered)))
                answered.append((row + 1, count, note_at))
            else:
                order.append((False, len(plain)))
                plain.append((row + 1, count))
            row = end = row + 1 + rows
            continue
        # a bad frame: its count cannot be trusted, so look for the next row that starts a valid one
        if starts is None:
            magics = np.frombuffer(raw, np.uint8, n_rows * ROW_SIZE).view(_HEADER_DTYPE)["magic"]
            starts = np.flatnonzero(np.isin(magics, _MAGICS))
        later = starts[np.searchsorted(starts, row, side="right"):].tolist()
        row = next((r for r in later if _frame_at(view, r, n_rows) is not None), n_rows)
        corrupt += row < n_rows  # with no valid frame after it, it is the torn tail
    entries, answers, note_of = _gather(raw, plain, answered, order)
    return DispatchLogRead(entries, end * ROW_SIZE, corrupt, len(raw) - end * ROW_SIZE, answers, note_of, notes)


def read_dispatch_entries_of(path: str | os.PathLike[str], parts: np.ndarray,
                             offsets: np.ndarray) -> DispatchLogRead:
    """The entries (answers and notes with them) naming some records, without reading every frame:
    for a look-up of a few records in a large log (`timewheel find`).

    Rows whose (offset, part) bytes name one of the records are found with one vectorised pass over
    a read-only map; each is kept only if it is an entry row of a frame that passes its checks (the
    nearest frame start before it whose CRC holds, found in a window that widens until one is, and
    the row inside that frame's entries). A frame that fails its checks hides only its own entries,
    as with `read_dispatch_log`; the counters of what was found wrong cover the frames looked at."""
    try:
        raw = np.memmap(path, dtype=np.uint8, mode="r")
    except (FileNotFoundError, ValueError):  # no log, or an empty one (which cannot be mapped)
        return DispatchLogRead(np.empty(0, DISPATCH_DTYPE), 0, 0, 0)
    n_rows = len(raw) // ROW_SIZE
    if not n_rows:  # read while its first frame is being appended (a strided view would not fit)
        return DispatchLogRead(np.empty(0, DISPATCH_DTYPE), 0, 0, len(raw))
    # bytes 16..24 of every row as one uint64: offset, part, then outcome and attempts, masked off
    where = np.ndarray((n_rows,), "<u8", raw, _KEY_AT, (ROW_SIZE,)) & np.uint64(_KEY_MASK)
    wanted = (np.asarray(parts, np.uint64) << np.uint64(32)) | np.asarray(offsets, np.uint64)
    hits = np.sort(np.concatenate([np.flatnonzero(where == k) for k in wanted.tolist()] or [np.empty(0, np.int64)]))
    if not len(hits):
        return DispatchLogRead(np.empty(0, DISPATCH_DTYPE), len(raw), 0, 0)
    magics = np.ndarray((n_rows,), "<u4", raw, 0, (ROW_SIZE,))
    view = memoryview(raw)  # type: ignore[arg-type]  # an ndarray is a buffer
    frames: dict[int, tuple[int, int, int, str] | None] = {}
    order: list[tuple[bool, int]] = []
    plain: list[tuple[int, int]] = []
    answered: list[tuple[int, int, int]] = []
    notes: list[str] = []
    for r in hits.tolist():
        h, frame = _frame_before(view, magics, r, n_rows, frames)
        if frame is None:
            continue
        magic, count, _, note = frame
        first = h + 1
        if magic == FRAME_MAGIC_V3:
            if not (first <= r < first + 2 * count and (r - first) % 2 == 0):
                continue
            note_at = -1
            if note:
                notes.append(note)
                note_at = len(notes) - 1
            order.append((True, len(answered)))
            answered.append((r, 1, note_at))
        elif first <= r < first + count:
            order.append((False, len(plain)))
            plain.append((r, 1))
    entries, answers, note_of = _gather(view, plain, answered, order)
    bad = sum(f is None for f in frames.values())
    return DispatchLogRead(entries, len(raw), bad, 0, answers, note_of, notes)


_KEY_AT = DISPATCH_DTYPE.fields["offset"][1]  # type: ignore[index]  # offset, then part: one uint64 with the next 2 bytes
_KEY_MASK = (1 << 48) - 1
_WINDOW = 1024  # rows looked back at first for the frame a row belongs to; doubled until one is found


def _frame_before(view: memoryview, magics: np.ndarray, row: int, n_rows: int,
                  seen: dict[int, tuple[int, int, int, str] | None]) -> tuple[int, tuple[int, int, int, str] | None]:
    """The nearest row before `row` that starts a valid frame, and that frame (None: there is none)."""
    window, end = _WINDOW, row
    while end > 0:
        start = max(0, row - window)
        for h in np.flatnonzero(np.isin(magics[start:end], _MAGICS))[::-1].tolist():
            h += start
            if h not in seen:
                seen[h] = _frame_at(view, h, n_rows)
            if seen[h] is not None:
                return h, seen[h]
        end, window = start, window * 2
    return -1, None


def _gather(raw: bytes | memoryview, plain: list[tuple[int, int]], answered: list[tuple[int, int, int]],
            order: list[tuple[bool, int]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Entries, answers and note indices of the valid frames, in file order (one copy of each
    kind's rows: numpy's concatenate of structured arrays costs more than the bytes)."""
    view = memoryview(raw)
    plain_rows = np.frombuffer(b"".join([view[f * ROW_SIZE:(f + c) * ROW_SIZE] for f, c in plain]), DISPATCH_DTYPE)
    if not answered:  # logs written before answers existed, and frames of other outcomes
        return plain_rows, no_answers(len(plain_rows)), np.full(len(plain_rows), -1, np.int32)
    both = np.frombuffer(b"".join([view[f * ROW_SIZE:(f + 2 * c) * ROW_SIZE] for f, c, _ in answered]),
                         _ANSWERED_DTYPE)
    counts = np.array([answered[i][1] if a else plain[i][1] for a, i in order], np.int64)
    kinds = np.array([a for a, _ in order], bool)
    starts = np.cumsum(counts) - counts  # where each frame's entries begin in the result
    where = np.repeat(starts, counts) + _ranks(counts)  # each entry's place, frame by frame
    is_answered = np.repeat(kinds, counts)
    total = int(counts.sum())
    entries = np.empty(total, DISPATCH_DTYPE)
    answers = no_answers(total)
    note_of = np.full(total, -1, np.int32)
    entries[where[~is_answered]] = plain_rows
    at = where[is_answered]
    for name in DISPATCH_DTYPE.names:  # type: ignore[union-attr]
        entries[name][at] = both[name]
    for name in ANSWER_DTYPE.names:  # type: ignore[union-attr]
        answers[name][at] = both[name]
    note_of[at] = np.repeat(np.array([n for _, _, n in answered], np.int32),
                            np.array([c for _, c, _ in answered], np.int64))
    return entries, answers, note_of


def _ranks(counts: np.ndarray) -> np.ndarray:
    """0..count-1 for each count, concatenated."""
    total = int(counts.sum())
    return np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)


def _frame_at(view: memoryview, row: int, n_rows: int) -> tuple[int, int, int, str] | None:
    """(magic, entry count, rows after the header, note) of the valid frame starting at `row`, or None."""
    at = row * ROW_SIZE
    magic, count, crc, note_len, _ = _HEADER.unpack_from(view, at)
    if magic not in _MAGICS:
        return None
    if magic == FRAME_MAGIC_V3:
        if note_len > MAX_NOTE:
            return None
        rows = 2 * count + -(-note_len // ROW_SIZE)
    else:
        rows = count
    if row + 1 + rows > n_rows:
        return None
    body = view[at + ROW_SIZE:at + (1 + rows) * ROW_SIZE]
    found = crc32c(body) if magic == FRAME_MAGIC_V1 else frame_crc(bytes(view[at:at + ROW_SIZE]), body)
    if found != crc:
        return None
    note = ""
    if magic == FRAME_MAGIC_V3 and note_len:
        text_at = at + (1 + 2 * count) * ROW_SIZE
        note = bytes(view[text_at:text_at + note_len]).decode("utf-8", "replace")
    return magic, count, rows, note
