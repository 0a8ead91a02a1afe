"""The dispatch writer: a frame that fails on its way to disk is cut, whatever part of it got there."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from storage import DELIVERED, StorageWriteError, dispatch_entries, no_answers
from storage import _dispatch_writer
from storage.dispatch import DispatchLogRead, encode_frame, read_dispatch_log
from storage.layout import SegmentLayout

SEG = 1_800_000_000_000 - 1_800_000_000_000 % 3_600_000
NOW = SEG + 1_000


def _entries(n: int, first: int = 0) -> np.ndarray:
    offsets = np.arange(first, first + n, dtype=np.uint32) * 100
    return dispatch_entries(np.zeros(n, np.uint16), offsets, np.full(n, NOW, np.int64), NOW + 1, DELIVERED, 1)


def _answers(n: int) -> np.ndarray:
    out = no_answers(n)
    out["queue_offset"] = np.arange(n)
    out["commit_offset"] = np.arange(n) * 7
    out["store_ip"] = (127, 0, 0, 1)
    out["store_port"] = 10911
    out["queue_id"] = 3
    return out


@pytest.mark.parametrize(("sync", "fail_after"), [(False, 0), (False, 1), (False, 30), (True, 0), (True, 30),
                                                   (True, None)])
def test_a_failed_append_leaves_the_frames_before_it_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           sync: bool, fail_after: int | None) -> None:
    """`fail_after` bytes of the frame reach the file, then the disk refuses (None: the whole frame
    is written and the sync fails): the log reads as the frames before it, nothing torn."""
    w = _dispatch_writer.DispatchWriter(SegmentLayout(tmp_path / "d"), sync=sync)
    try:
        w.append(SEG, _entries(3), NOW, _answers(3))
        real_write, real_sync = os.write, os.fdatasync
        budget = [fail_after]

        def failing_write(fd: int, data: bytes | memoryview) -> int:
            left = budget[0]
            if left is None:
                return real_write(fd, data)
            if not left:
                raise OSError(28, "No space left on device")
            n = real_write(fd, bytes(data[:left]))
            budget[0] = left - n
            return n

        def failing_sync(fd: int) -> None:
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(_dispatch_writer.os, "write", failing_write)
        monkeypatch.setattr(_dispatch_writer.os, "fdatasync", failing_sync)
        with pytest.raises(StorageWriteError):
            w.append(SEG, _entries(2, first=3), NOW, _answers(2))
        monkeypatch.setattr(_dispatch_writer.os, "write", real_write)
        monkeypatch.setattr(_dispatch_writer.os, "fdatasync", real_sync)
        read = read_dispatch_log(w.layout.dispatch_log(SEG))
        assert (read.torn_bytes, read.corrupt_frames) == (0, 0)
        assert read.entries["offset"].tolist() == [0, 100, 200]
        w.append(SEG, _entries(1, first=9), NOW)  # the log goes on after the failure
        assert read_dispatch_log(w.layout.dispatch_log(SEG)).entries["offset"].tolist() == [0, 100, 200, 900]
    finally:
        w.close()


def test_a_failed_append_whose_cut_fails_too_is_a_write_error_and_the_next_append_cuts_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk refuses the rest of a frame, then its cut: the error is still `StorageWriteError`
    (the engine's outcome path handles that one), and the torn bytes are cut when the log is next
    opened, as after a crash, before anything else is appended."""
    w = _dispatch_writer.DispatchWriter(SegmentLayout(tmp_path / "d"), sync=False)
    try:
        w.append(SEG, _entries(3), NOW)
        real_write, real_truncate = os.write, os.ftruncate

        calls = [0]

        def torn_write(fd: int, data: bytes | memoryview) -> int:  # a short write, then a full disk
            calls[0] += 1
            if calls[0] > 1:
                raise OSError(28, "No space left on device")
            return real_write(fd, bytes(data[:30]))

        def failing_truncate(fd: int, length: int) -> None:
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(_dispatch_writer.os, "write", torn_write)
        monkeypatch.setattr(_dispatch_writer.os, "ftruncate", failing_truncate)
        with pytest.raises(StorageWriteError, match="cutting its 30 bytes failed too"):
            w.append(SEG, _entries(2, first=3), NOW)
        monkeypatch.setattr(_dispatch_writer.os, "write", real_write)
        monkeypatch.setattr(_dispatch_writer.os, "ftruncate", real_truncate)
        assert read_dispatch_log(w.layout.dispatch_log(SEG)).torn_bytes == 30
        w.append(SEG, _entries(1, first=9), NOW)
        read = read_dispatch_log(w.layout.dispatch_log(SEG))
        assert (read.torn_bytes, read.corrupt_frames) == (0, 0)
        assert read.entries["offset"].tolist() == [0, 100, 200, 900]
    finally:
        w.close()


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 5), note=st.sampled_from(["", "a note"]))
def test_a_frame_of_one_entry_reads_back_as_a_frame_of_several_does(n: int, note: str) -> None:
    """The one-entry frame (its two rows as they are) and the interleaved one read back alike."""
    entries, answers = _entries(n), _answers(n)
    frame = encode_frame(entries, NOW, answers, note)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "log"
        path.write_bytes(frame)
        read = read_dispatch_log(path)
    assert read.corrupt_frames == 0 and read.entries.tobytes() == entries.tobytes()
    assert read.answers is not None and read.answers.tobytes() == answers.tobytes()


def _open_logs(root: Path) -> int:
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith(str(root))
        except OSError:
            continue
    return n


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads the descriptors in /proc")
def test_only_the_logs_written_last_stay_open_and_a_checkpoint_syncs_the_others_by_path(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A data directory that keeps every segment must not hold a descriptor per segment it ever
    delivered from: past `MAX_OPEN_LOGS` the least recently written log is closed, and opened again
    without reading it whole for a torn tail (it has none: this writer closed it)."""
    tail_reads: list[Path] = []
    real_read = _dispatch_writer._dispatch.read_dispatch_log

    def counted_read(path: Path) -> DispatchLogRead:
        tail_reads.append(Path(path))
        return real_read(path)

    monkeypatch.setattr(_dispatch_writer._dispatch, "read_dispatch_log", counted_read)
    layout = SegmentLayout(tmp_path)
    writer = _dispatch_writer.DispatchWriter(layout, sync=False)
    hour = 3_600_000
    segments = [SEG + k * hour for k in range(_dispatch_writer.MAX_OPEN_LOGS + 4)]
    try:
        for seg in segments:
            writer.append(seg, _entries(2), NOW)
        assert _open_logs(tmp_path) == _dispatch_writer.MAX_OPEN_LOGS
        fds, paths, _ = writer.take_unsynced()
        for fd in fds:
            os.close(fd)
        assert len(fds) == _dispatch_writer.MAX_OPEN_LOGS
        assert sorted(paths) == sorted(layout.dispatch_log(seg) for seg in segments[:4])
        tail_reads.clear()
        writer.append(segments[0], _entries(3, first=2), NOW + 1)  # closed, opened again: appended after
        assert tail_reads == []
        frames = read_dispatch_log(layout.dispatch_log(segments[0]))
        assert frames.torn_bytes == 0 and len(frames.entries) == 5
        assert _open_logs(tmp_path) == _dispatch_writer.MAX_OPEN_LOGS
    finally:
        writer.close()


def test_the_engine_does_not_cut_another_writers_frame_on_its_way(tmp_path: Path) -> None:
    """Replay appends REPLAYED frames to a dispatch log the engine also writes. The engine opening
    the log read a replay frame half copied, took it for a crash's torn tail and cut it: the rest of
    it then landed as garbage, and the replay's record was lost."""
    import threading

    layout = SegmentLayout(tmp_path)
    path = layout.dispatch_log(SEG)
    path.parent.mkdir(parents=True)
    path.write_bytes(encode_frame(_entries(2), NOW))
    replayed = encode_frame(_entries(3, first=10), NOW + 5)
    with open(path, "ab") as f:
        f.write(replayed[:40])  # the replay's write, half copied when the engine reads

    def the_rest() -> None:
        with open(path, "ab") as f:
            f.write(replayed[40:])

    finisher = threading.Timer(_dispatch_writer.TORN_SETTLE_S / 4, the_rest)
    finisher.start()
    writer = _dispatch_writer.DispatchWriter(layout, sync=False)
    writer.append(SEG, _entries(1, first=20), NOW + 9)
    finisher.join()
    writer.close()
    read = read_dispatch_log(path)
    assert read.torn_bytes == 0 and read.corrupt_frames == 0
    assert read.entries["offset"].tolist() == [0, 100, 1000, 1100, 1200, 2000]  # the old code: the replay's gone


def test_a_torn_tail_that_stands_still_is_still_cut(tmp_path: Path) -> None:
    layout = SegmentLayout(tmp_path)
    path = layout.dispatch_log(SEG)
    path.parent.mkdir(parents=True)
    path.write_bytes(encode_frame(_entries(2), NOW) + encode_frame(_entries(3, first=10), NOW)[:40])
    writer = _dispatch_writer.DispatchWriter(layout, sync=False)
    writer.append(SEG, _entries(1, first=20), NOW + 9)
    writer.close()
    read = read_dispatch_log(path)
    assert read.torn_bytes == 0 and read.corrupt_frames == 0
    assert read.entries["offset"].tolist() == [0, 100, 2000]


def test_another_writers_frame_waits_for_the_engines_cut_and_lands_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's write stops short (a full disk), a replay's frame comes meanwhile, then the
    engine cuts its torn bytes. The cut once took the size at that moment, so it cut the end of the
    replay's frame and kept the engine's torn bytes: the replay's record was unreadable. Under the
    log's lock the replay's frame waits for the cut and lands whole after the frames before."""
    import threading

    layout = SegmentLayout(tmp_path / "d")
    w = _dispatch_writer.DispatchWriter(layout, sync=False)
    replay: list[BaseException | None] = []

    def replay_append() -> None:
        try:
            _dispatch_writer.append_dispatch(layout, SEG, _entries(2, first=5), NOW + 5)
            replay.append(None)
        except BaseException as e:  # reported by the assertion below
            replay.append(e)

    replayer = threading.Thread(target=replay_append)
    try:
        w.append(SEG, _entries(3), NOW)
        real_write, engine = os.write, threading.current_thread()
        calls = [0]

        def torn_write(fd: int, data: bytes | memoryview) -> int:
            if threading.current_thread() is not engine:
                return real_write(fd, data)
            calls[0] += 1
            if calls[0] > 1:
                raise OSError(28, "No space left on device")
            n = real_write(fd, bytes(data[:30]))
            replayer.start()
            replayer.join(0.3)  # it waits for the lock (the old code: it wrote after the 30 bytes)
            return n

        monkeypatch.setattr(_dispatch_writer.os, "write", torn_write)
        with pytest.raises(StorageWriteError, match="No space left"):
            w.append(SEG, _entries(2, first=3), NOW)
        monkeypatch.setattr(_dispatch_writer.os, "write", real_write)
        replayer.join(10)
        assert replay == [None]
        read = read_dispatch_log(layout.dispatch_log(SEG))
        assert (read.torn_bytes, read.corrupt_frames) == (0, 0)
        assert read.entries["offset"].tolist() == [0, 100, 200, 500, 600]
    finally:
        w.close()


def test_another_writers_short_write_is_cut_before_the_engine_appends_after_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A replay's write stops short with the engine's log already open: its torn bytes were left,
    the engine's next frame started inside their rows and could not be read. Now `append_dispatch`
    cuts its own torn bytes under the lock, and says it failed."""
    layout = SegmentLayout(tmp_path / "d")
    w = _dispatch_writer.DispatchWriter(layout, sync=False)
    try:
        w.append(SEG, _entries(3), NOW)
        real_write = os.write
        calls = [0]

        def torn_write(fd: int, data: bytes | memoryview) -> int:
            calls[0] += 1
            if calls[0] > 1:
                raise OSError(28, "No space left on device")
            return real_write(fd, bytes(data[:30]))

        monkeypatch.setattr(_dispatch_writer.os, "write", torn_write)
        with pytest.raises(StorageWriteError, match="No space left"):
            _dispatch_writer.append_dispatch(layout, SEG, _entries(2, first=5), NOW + 5)
        monkeypatch.setattr(_dispatch_writer.os, "write", real_write)
        w.append(SEG, _entries(1, first=9), NOW + 9)  # on the descriptor it had open: no tail read
        read = read_dispatch_log(layout.dispatch_log(SEG))
        assert (read.torn_bytes, read.corrupt_frames) == (0, 0)
        assert read.entries["offset"].tolist() == [0, 100, 200, 900]
    finally:
        w.close()


def test_a_writer_stopped_while_it_holds_the_log_is_waited_for_a_bounded_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process holds a dispatch log's lock and never lets go (a replay stopped with Ctrl-Z
    in its write): the engine's append waits `LOCK_WAIT_S`, then fails in words that name the log,
    instead of hanging its delivery for ever."""
    import subprocess
    import sys
    import time

    monkeypatch.setattr(_dispatch_writer, "LOCK_WAIT_S", 0.5)
    layout = SegmentLayout(tmp_path / "d")
    w = _dispatch_writer.DispatchWriter(layout, sync=False)
    holder = None
    try:
        w.append(SEG, _entries(3), NOW)
        path = layout.dispatch_log(SEG)
        holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time\n"
                                   f"f = open({str(path)!r}, 'ab'); fcntl.flock(f, fcntl.LOCK_EX)\n"
                                   "print('held', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        t0 = time.monotonic()
        with pytest.raises(StorageWriteError, match=r"could not lock .*dispatch.*held its lock for 0.5 s.*fuser"):
            w.append(SEG, _entries(2, first=3), NOW)
        assert time.monotonic() - t0 >= 0.5  # it waited, then gave up
        with pytest.raises(StorageWriteError, match="held its lock"):  # a replay's append is bounded too
            _dispatch_writer.append_dispatch(layout, SEG, _entries(1, first=7), NOW)
        holder.kill()
        holder.wait()
        holder = None
        w.append(SEG, _entries(2, first=3), NOW)  # once it is gone, the log goes on
        assert read_dispatch_log(path).entries["offset"].tolist() == [0, 100, 200, 300, 400]
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
        w.close()
