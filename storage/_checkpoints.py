"""Checkpoints: what was written since the last one is fsynced in the parts, then replay moves on.

A checkpoint is two steps. The rotation, under the store's write lock, takes what was written since
the last one (duplicated descriptors, paths, new directories) and rolls the ingest log to a new
file. The finish, outside the lock, fsyncs them and moves the checkpoint (where replay starts) to
that file, and lets the older files go.

Two rotations can be in flight at once (housekeeping's, and a commit's whose ingest log file grew
past `checkpoint_bytes`), and their finishes can run in either order. They are finished in rotation
order: a finish first fsyncs what every earlier rotation took, so the checkpoint never moves past a
file that is not yet fsynced.

An fsync that fails stops checkpoints for the rest of the process. The kernel may have dropped the
pages it could not write, and marked them clean: fsyncing again would succeed and prove nothing.
The checkpoint stays where it was, the ingest log since it is kept, and every later checkpoint
fails with the first error (the engine is not ready meanwhile); a restart replays the log.
"""
from __future__ import annotations

import os
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from storage._files import fsync_path
from storage.errors import StorageWriteError

if TYPE_CHECKING:
    from storage._dispatch_writer import DispatchWriter
    from storage._writer import PartWriter
    from storage.ingest_log import IngestLog
    from storage.layout import SegmentLayout
    from storage.meta import MetaStore


@dataclass(slots=True)
class Rotation:
    """What one rotation took: the new ingest log file's number and what to fsync before replay
    may start there (duplicated descriptors, files by path, directories that gained a name)."""

    seq: int
    fds: list[int] = field(default_factory=list)
    paths: list[Path] = field(default_factory=list)
    dirs: list[Path] = field(default_factory=list)


class Checkpoints:
    """Rotations and their finishes, in order (see the module's docstring)."""

    def __init__(self, layout: "SegmentLayout", meta: "MetaStore", wal: "IngestLog", writer: "PartWriter",
                 dispatch_writer: "DispatchWriter") -> None:
        self._layout, self._meta, self._wal = layout, meta, wal
        self._writer, self._dispatch_writer = writer, dispatch_writer
        self._lock = threading.Lock()
        self._unfinished: deque[Rotation] = deque()
        #: the ingest log file replay starts at since the last finished checkpoint (-1: none yet)
        self.durable_seq = -1
        #: the failed fsync that stopped checkpoints, if one did
        self.broken: str | None = None

    def rotate(self) -> Rotation:
        """Under the store's write lock: take what is unsynced and roll the ingest log to a new file."""
        seq = max([self._wal.seq, *self._wal.sequences()], default=-1) + 1
        self._wal.open_new(seq)  # first: if it fails, what is unsynced stays for the next rotation
        self._writer.log_seq = seq
        parts = self._writer.take_unsynced()
        dispatch_fds, dispatch_paths, dispatch_dirs = self._dispatch_writer.take_unsynced()
        rotation = Rotation(seq, parts.fds + dispatch_fds, parts.paths + dispatch_paths,
                            [*dispatch_dirs, *parts.dirs])
        self._unfinished.append(rotation)
        return rotation

    def finish(self, rotation: Rotation) -> None:
        """fsync what this rotation and every earlier one took, then move the checkpoint to its file.

        Raises StorageWriteError if an fsync fails, now or in an earlier finish.
        """
        with self._lock:
            while self._unfinished and self._unfinished[0].seq <= rotation.seq:
                self._sync(self._unfinished.popleft())
            if self.broken is not None:
                raise StorageWriteError(f"checkpoints are stopped: {self.broken}; the ingest log since the last "
                                        "checkpoint is kept, and a restart replays it")
            if rotation.seq <= self.durable_seq:
                return
            self._meta.flush()
            try:  # the new log file's name: its directory's fsync failing stops checkpoints as a file's does
                fsync_path(self._layout.ingest_dir)
            except OSError as e:
                self.broken = f"the fsync of the ingest log's directory before checkpoint {rotation.seq} failed ({e})"
                raise StorageWriteError(f"checkpoints are stopped: {self.broken}; the ingest log since the last "
                                        "checkpoint is kept, and a restart replays it") from e
            self._meta.put_document("checkpoint", {"seq": rotation.seq, "pos": 0})
            self._meta.flush()
            self._wal.remove_before(rotation.seq)
            self.durable_seq = rotation.seq

    def _sync(self, rotation: Rotation) -> None:
        """fsync one rotation's files, unless checkpoints are stopped; its descriptors are closed either way."""
        try:
            if self.broken is None:
                for fd in rotation.fds:
                    os.fsync(fd)
                for path in rotation.paths:
                    fsync_path(path)
                for d in rotation.dirs:  # a new part's or dispatch log's name: lost with its directory otherwise
                    fsync_path(d)
        except OSError as e:
            self.broken = f"an fsync before checkpoint {rotation.seq} failed ({e})"
        finally:
            for fd in rotation.fds:
                os.close(fd)
