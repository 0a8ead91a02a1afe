"""Appending to segments' dispatch logs: one open descriptor per segment recently written, one write per frame."""
from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

from storage import dispatch as _dispatch
from storage._files import fsync_path, lock_exclusive, unlock
from storage.errors import StorageWriteError
from storage.layout import SegmentLayout

#: dispatch logs kept open at most (the least recently written closes first): a data directory that
#: keeps every segment would otherwise hold a descriptor per segment it ever delivered from
MAX_OPEN_LOGS = 16
#: how long a torn tail is watched before it is cut: another writer's frame may be on its way
TORN_SETTLE_S = 0.1
#: what a filesystem without `flock` leaves unsafe (said once)
_UNSAFE_WITHOUT_LOCKS = "a replay or `check` appending to a dispatch log the engine is writing"
#: how long a writer waits for another's lock on a log (it holds it for one write): past that,
#: an error that names the log (a process stopped halfway through its write holds it for ever)
LOCK_WAIT_S = 10.0


class DispatchWriter:
    """Appends frames to dispatch logs; with `sync`, each frame (and a new log's name) is durable
    before `append` returns."""

    def __init__(self, layout: SegmentLayout, sync: bool) -> None:
        self.layout = layout
        self.sync = sync
        self.lock = threading.Lock()
        self._fds: OrderedDict[int, int] = OrderedDict()
        #: logs this writer closed whole (past `MAX_OPEN_LOGS`): opened again without reading them for a torn tail
        self._closed_whole: set[int] = set()
        self._dirty: set[int] = set()
        self._new_dirs: set[Path] = set()

    def append(self, segment_ms: int, entries: np.ndarray, now_ms: int, answers: np.ndarray | None = None,
               note: str = "") -> None:
        """Append entries (DISPATCH_DTYPE) to a segment's dispatch log as one frame, with the broker's
        answers (ANSWER_DTYPE, aligned) and a note when given."""
        if len(entries) == 0:
            return
        frame = _dispatch.encode_frame(entries, now_ms, answers, note)
        with self.lock:
            fd = self._fds.get(segment_ms)
            if fd is None:
                fd = self._fds[segment_ms] = self._open(segment_ms)
                if len(self._fds) > MAX_OPEN_LOGS:  # a log written since the checkpoint is fsynced by path
                    oldest, old_fd = self._fds.popitem(last=False)
                    os.close(old_fd)
                    self._closed_whole.add(oldest)
            else:
                self._fds.move_to_end(segment_ms)
            try:
                self._write(fd, segment_ms, frame, len(entries))
            except BaseException:  # the next frame opens it again and reads its tail, as after a crash
                os.close(self._fds.pop(segment_ms))
                raise
            if not self.sync:
                self._dirty.add(segment_ms)

    def _write(self, fd: int, segment_ms: int, frame: bytes, n_entries: int) -> None:
        """Write one frame (and, with `sync`, flush it); on failure cut whatever part of it got there."""
        append_frame(fd, self.layout.dispatch_log(segment_ms), frame, n_entries, sync=self.sync)

    def _open(self, segment_ms: int) -> int:
        """Open a segment's dispatch log for appending, its torn tail cut first."""
        path = self.layout.dispatch_log(segment_ms)
        seg_dir_new = not path.parent.exists()
        log_new = seg_dir_new or not path.exists()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if segment_ms in self._closed_whole:  # every frame of it whole: this writer wrote and closed it
            self._closed_whole.discard(segment_ms)
        else:
            try:
                cut_torn_tail(fd, path)
            except BaseException:
                os.close(fd)
                raise
        if log_new:
            # `schedule/` too, the segment directory being there already or not: the part writer may
            # have made it since the last checkpoint, and its name is not durable before then
            dirs = [path.parent, self.layout.schedule_dir]
            if self.sync:  # the frames about to be synced are only as durable as the file's name
                try:
                    for d in dirs:
                        fsync_path(d)
                except OSError:  # the descriptor is not in `_fds` yet: nothing else would close it
                    os.close(fd)
                    raise
            else:
                self._new_dirs.update(dirs)
        return fd

    def take_unsynced(self) -> tuple[list[int], list[Path], list[Path]]:
        """What was written since the last call, for a checkpoint to fsync: duplicated descriptors
        of the logs still open, the paths of those closed since, and directories that gained a log."""
        with self.lock:
            fds = [os.dup(self._fds[seg]) for seg in self._dirty if seg in self._fds]
            paths = [self.layout.dispatch_log(seg) for seg in self._dirty if seg not in self._fds]
            dirs = sorted(self._new_dirs, key=lambda d: len(d.parts), reverse=True)  # children first
            self._dirty, self._new_dirs = set(), set()
        return fds, paths, dirs

    def forget(self, segment_ms: int) -> None:
        """Close a segment's log (the segment is being retired)."""
        with self.lock:
            fd = self._fds.pop(segment_ms, None)
            if fd is not None:
                os.close(fd)
            self._dirty.discard(segment_ms)
            self._closed_whole.discard(segment_ms)

    def close(self) -> None:
        """Close every log."""
        with self.lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def append_frame(fd: int, path: Path, frame: bytes, n_entries: int, *, sync: bool) -> None:
    """Append one frame to the dispatch log at `path`, open as `fd` with O_APPEND, under the log's lock
    (and with `sync` flush it); on failure cut whatever part of it got there before letting the lock go.

    Every writer (the engine, replay, `check`) appends through here, so none appends between another's
    short write and its cut: the cut takes that frame's bytes only, and no frame starts inside another's
    rows (every read would resync past both). A cut that fails too leaves torn bytes at the end, which
    the next open of the log cuts (the rule for a crash's torn tail).
    """
    try:
        lock_exclusive(fd, path.parent, _UNSAFE_WITHOUT_LOCKS, LOCK_WAIT_S)
    except OSError as e:
        raise StorageWriteError(f"could not lock {path} to record {n_entries} dispatch entries: {e}; "
                                f"`fuser {path}` names the processes that have it open") from e
    view, written = memoryview(frame), 0  # of this frame: where it began is known on failure, no seek
    try:
        while written < len(frame):  # O_APPEND: at the end
            written += os.write(fd, view[written:])
        if sync:
            os.fdatasync(fd)
    except OSError as e:
        also = ""
        try:
            os.ftruncate(fd, os.fstat(fd).st_size - written)
        except OSError as cut:
            also = f"; cutting its {written} bytes failed too ({cut}), the next append cuts them"
        raise StorageWriteError(f"could not record {n_entries} dispatch entries in {path}: {e}{also}") from e
    finally:
        unlock(fd)  # an error here (never seen) goes up as it is: the caller's close lets the lock go


def cut_torn_tail(fd: int, path: Path) -> int:
    """Cut a torn frame (a crash's) at the end of the dispatch log open as `fd` (for writing);
    how many bytes were cut. A frame appended after it would start inside its rows, and every read
    would resync past both. Under the log's lock: no writer is halfway through a frame meanwhile."""
    try:  # nor is a writer stopped halfway through its write waited for for ever
        lock_exclusive(fd, path.parent, _UNSAFE_WITHOUT_LOCKS, LOCK_WAIT_S)
    except OSError as e:
        raise StorageWriteError(f"could not lock {path} to read its tail: {e}; "
                                f"`fuser {path}` names the processes that have it open") from e
    try:
        before = _dispatch.read_dispatch_log(path)
        deadline = time.monotonic() + LOCK_WAIT_S
        while before.torn_bytes:
            # ...unless it is the frame of a writer that takes no lock, on its way (one O_APPEND
            # write can be read half copied): only a tail that stands still is cut
            time.sleep(TORN_SETTLE_S)
            now = _dispatch.read_dispatch_log(path)
            if (now.valid_bytes, now.torn_bytes) == (before.valid_bytes, before.torn_bytes):
                os.ftruncate(fd, now.valid_bytes)
                return now.torn_bytes
            if time.monotonic() >= deadline:
                raise StorageWriteError(f"the end of {path} kept changing for {LOCK_WAIT_S:g} s under its lock: it is "
                                        "still being written by a process that takes no lock on it (an engine of "
                                        f"an older build?); stop it (`fuser {path}` names who has it open)")
            before = now
        return 0
    finally:
        unlock(fd)


def cut_dispatch_tail(path: Path) -> int:
    """`cut_torn_tail` for a log no writer of this process has open (replay, `check`): bytes cut."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    except OSError as e:
        raise StorageWriteError(f"cannot open {path} to cut its torn tail: {e}") from e
    try:
        return cut_torn_tail(fd, path)
    finally:
        os.close(fd)


def append_dispatch(layout: SegmentLayout, segment_ms: int, entries: np.ndarray, now_ms: int) -> None:
    """Append one frame to a segment's dispatch log from outside the engine (replay, `check`), durably:
    one O_APPEND write (so it interleaves whole with the engine's), fsynced, with a new log's name too.

    It cuts no torn tail it finds there (`cut_dispatch_tail` does, once the tail stands still): the
    engine may be writing there.
    """
    if len(entries) == 0:
        return
    path = layout.dispatch_log(segment_ms)
    frame = _dispatch.encode_frame(entries, now_ms)
    new = not path.exists()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        append_frame(fd, path, frame, len(entries), sync=False)
        try:
            os.fsync(fd)  # outside the lock: the engine's sends need not wait for this disk flush
        except OSError as e:
            raise StorageWriteError(f"could not make {len(entries)} dispatch entries durable in {path}: {e}") from e
    finally:
        os.close(fd)
    if new:
        fsync_path(path.parent)
