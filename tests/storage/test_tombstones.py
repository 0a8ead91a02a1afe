"""The tombstone log: its bytes, round trips, torn tails cut, corrupt frames skipped, compaction."""
from __future__ import annotations

import struct
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from storage import InvalidRecordError, Tombstone, TombstoneLog
from storage.record import crc32c
from storage.tombstones import ENTRY_HEADER, FRAME_HEADER, ID, KEY, decode_frames, encode_frame

T0 = 1_800_000_000_000


@pytest.mark.parametrize("tombstones,hexed", [
    pytest.param([Tombstone(ID, "A", 5, 7)], "5457433101000000190000000e9a9ce70a00000000000000"
                 "0100010000000000050000000000000007000000000000004" "1", id="one-id"),
], )
def test_known_bytes(tombstones: list[Tombstone], hexed: str) -> None:
    frame = encode_frame(tombstones, 10)
    assert frame.hex() == hexed
    magic, count, length, crc, written = FRAME_HEADER.unpack_from(frame)
    assert (magic, count, length, written) == (0x31435754, 1, ENTRY_HEADER.size + 1, 10)
    # the CRC covers the header without its crc field, then the payload
    assert crc == crc32c(frame[FRAME_HEADER.size:], crc32c(frame[16:24], crc32c(frame[:12])))


_text = st.text(st.characters(blacklist_categories=["Cs"]), min_size=1, max_size=40)
_tomb = st.builds(Tombstone, st.sampled_from([ID, KEY]), _text, st.integers(-(1 << 63), (1 << 63) - 1),
                  st.integers(-(1 << 63), (1 << 63) - 1))


@given(st.lists(st.lists(_tomb, min_size=1, max_size=5), max_size=5))
def test_frames_round_trip(frames: list[list[Tombstone]]) -> None:
    data = b"".join(encode_frame(f, T0) for f in frames)
    read = decode_frames(data)
    assert read.tombstones == [t for f in frames for t in f]
    assert (read.corrupt_frames, read.valid_end) == (0, len(data))


def test_the_encoder_refuses_what_the_layout_cannot_hold() -> None:
    for bad in (Tombstone(3, "x", 0, 0), Tombstone(ID, "", 0, 0), Tombstone(KEY, "x" * 70_000, 0, 0),
                Tombstone(ID, "x", 1 << 63, 0)):
        with pytest.raises(InvalidRecordError):
            encode_frame([bad], T0)


def test_append_read_and_torn_tail_cut(tmp_path: Path) -> None:
    log = TombstoneLog(tmp_path, sync=True)
    log.append([Tombstone(ID, "a", 1, 2)], T0)
    log.append([Tombstone(KEY, "k", 3, 4), Tombstone(ID, "b", 5, 6)], T0)
    log.close()
    whole = log.path.stat().st_size
    with open(log.path, "ab") as f:
        f.write(encode_frame([Tombstone(ID, "torn", 0, 0)], T0)[:-3])  # a crash mid-append
    read = TombstoneLog(tmp_path).read()
    assert [t.text for t in read.tombstones] == ["a", "k", "b"]
    assert log.path.stat().st_size == whole  # the torn frame is cut before anything is appended after it


def test_a_corrupt_frame_is_skipped_and_the_frames_after_it_kept(tmp_path: Path) -> None:
    log = TombstoneLog(tmp_path)
    log.append([Tombstone(ID, "a", 1, 2)], T0)
    first_end = log.path.stat().st_size
    log.append([Tombstone(ID, "b", 1, 2)], T0)
    log.append([Tombstone(ID, "c", 1, 2)], T0)
    log.close()
    data = bytearray(log.path.read_bytes())
    data[first_end + FRAME_HEADER.size + ENTRY_HEADER.size] ^= 0xFF  # a flipped bit in "b"
    log.path.write_bytes(bytes(data))
    read = TombstoneLog(tmp_path).read()
    assert [t.text for t in read.tombstones] == ["a", "c"] and read.corrupt_frames == 1
    assert log.path.stat().st_size == len(data)  # damage, not a tail: nothing cut


def test_rewrite_keeps_only_what_it_is_given(tmp_path: Path) -> None:
    log = TombstoneLog(tmp_path)
    log.append([Tombstone(ID, str(i), 0, i) for i in range(100)], T0)
    log.rewrite([Tombstone(KEY, "k", 1, 2)], T0)
    log.append([Tombstone(ID, "after", 0, 0)], T0)
    log.close()
    assert [t.text for t in TombstoneLog(tmp_path).read().tombstones] == ["k", "after"]
    assert not log.path.with_suffix(".tmp").exists()


def test_an_entry_that_does_not_fill_its_payload_is_corrupt() -> None:
    frame = bytearray(encode_frame([Tombstone(ID, "ab", 0, 0)], T0))
    struct.pack_into("<H", frame, FRAME_HEADER.size + 2, 1)  # text_len says 1, 2 bytes follow
    # re-seal the CRC so only the layout check can catch it
    crc = crc32c(bytes(frame[FRAME_HEADER.size:]), crc32c(bytes(frame[16:24]), crc32c(bytes(frame[:12]))))
    struct.pack_into("<I", frame, 12, crc)
    assert decode_frames(bytes(frame)).tombstones == []


def test_compaction_of_many_large_tombstones_survives_a_restart(tmp_path: Path) -> None:
    # 100k keys of 700 bytes: one frame would claim ~72 MB, which the reader once took for a torn
    # tail and cut, losing every tombstone on the next start
    live = [Tombstone(KEY, f"{i:08d}" + "k" * 692, 0, T0) for i in range(100_000)]
    log = TombstoneLog(tmp_path)
    log.rewrite(live, T0)
    read = TombstoneLog(tmp_path).read()
    assert len(read.tombstones) == len(live) and read.corrupt_frames == 0
    assert read.valid_end == log.path.stat().st_size


def test_frames_are_bounded() -> None:
    from storage.tombstones import MAX_WRITE_PAYLOAD, encode_frames
    many = [Tombstone(ID, "x" * 1000, 0, T0) for _ in range(5000)]
    frames = encode_frames(many, T0)
    assert len(frames) > 1
    assert all(FRAME_HEADER.unpack_from(f)[2] <= MAX_WRITE_PAYLOAD for f in frames)
    assert decode_frames(b"".join(frames)).tombstones == many


def test_a_large_well_formed_frame_is_read_not_cut(tmp_path: Path) -> None:
    # a file written before frames were bounded: one frame over the old 64 MiB sanity cap
    big = [Tombstone(KEY, "k" * 65_000, 0, T0) for _ in range(1040)]
    log = TombstoneLog(tmp_path)
    log.path.write_bytes(encode_frame(big, T0))
    read = log.read()
    assert len(read.tombstones) == len(big)
    assert log.path.stat().st_size > 64 << 20


def test_a_complete_bad_frame_at_the_end_is_reported_not_cut_silently(tmp_path: Path) -> None:
    log = TombstoneLog(tmp_path)
    log.append([Tombstone(ID, "a", 1, 2)], T0)
    log.append([Tombstone(ID, "b", 1, 2)], T0)
    log.close()
    data = bytearray(log.path.read_bytes())
    data[-1] ^= 0xFF  # the last frame is whole, its text damaged: damage, not a torn write
    log.path.write_bytes(bytes(data))
    read = TombstoneLog(tmp_path).read()
    assert [t.text for t in read.tombstones] == ["a"] and read.corrupt_frames == 1
    assert log.path.stat().st_size == len(data)


def test_close_and_flush_fsync_in_every_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    log = TombstoneLog(tmp_path, sync=False)
    log.append([Tombstone(ID, "a", 1, 2)], T0)  # creates the file (its directory is fsynced once then)
    synced: list[int] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(fd)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    log.append([Tombstone(ID, "b", 1, 2)], T0)
    assert not synced  # async: not on every append
    log.flush()
    assert len(synced) == 1
    log.append([Tombstone(ID, "c", 1, 2)], T0)
    log.close()
    assert len(synced) == 2


@pytest.mark.parametrize("sync", [False, True])
def test_a_new_log_file_is_durable_by_name_once_flushed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         sync: bool) -> None:
    """The engine's checkpoint fsyncs the tombstone log in every mode, so a cancel survives a power
    loss from then on; but a log file created without `sync` never had its directory fsynced, and
    its whole name (every tombstone in it) could vanish with the power however often it was flushed."""
    import os
    log = TombstoneLog(tmp_path, sync=sync)
    synced: list[Path] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    log.append([Tombstone(ID, "a", 1, 2)], T0)
    log.flush()  # the checkpoint's
    assert log.path.resolve() in synced
    assert log.path.parent.resolve() in synced, "the new file's name was never made durable"
    synced.clear()
    log.append([Tombstone(ID, "b", 1, 2)], T0)
    log.flush()
    log.close()
    assert log.path.parent.resolve() not in synced  # once is enough: the name stays
