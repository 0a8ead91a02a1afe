"""Which brokers served each target topic, remembered in the data directory across restarts.

The NameServer drops a broker from every route as soon as its connection closes, so a look-up made
right after the engine starts again, while a broker is down, cannot tell from the route alone that
the broker holds copies. The brokers seen serving a topic (in the delivery producer's routes and in
the look-ups' own) are kept here, and a look-up that finds one of them missing from the route now
leaves its keys unknown (`forwarder.copy_finder`).

The file, `<data_dir>/dedupe-brokers.txt`, is written only when a broker not yet remembered for a
topic shows up, and that pair is in it, fsynced, before `note` returns (the send through the broker
follows). Its first line is a comment (`#`); each other line is a JSON array: a broker name, then
target topics it served (its layout: `storage.broker_rows`, docs/FORMAT.md). What is new is
appended as rows, so a producer that names a new target topic per message costs one short line and
one fsync per topic, not a rewrite of everything known; the file is rewritten whole (under a
temporary name, fsynced, renamed: one row a broker) only when it is created, or has grown past
twice its bytes so written plus `_SLACK`, which keeps the bytes written in proportion to the file.
It is read again only when its size, inode or times changed since this process last read or wrote
it. A crash inside an append can leave a last line without its line break that is not a row: that
note never returned, so nothing was sent through it, and the line is cut when the file is read.

Nothing is ever forgotten by itself: an operator removes a broker gone for good by deleting its
lines, which the next look-up that misses it reads (docs/OPERATIONS.md). A file that cannot be read
(any other line that is not a row) is left as it is, and every look-up's keys stay unknown until it
is mended or deleted.

In a replica set, only the holder's producer sends: what its file learns is published to the other
replicas, which add it to theirs (`note_all`, `watch`, `snapshot`; `coordination._shared_brokers`).
"""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path

from storage import BrokerRowsError, broker_rows_of, broker_topics_of, decode_broker_lines, encode_broker_lines
from storage.broker_rows import cut_torn

__all__ = ["SERVED_BROKERS_FILE", "ServedBrokers"]

log = logging.getLogger("timewheel.dedupe")

#: the file in the engine's data directory
SERVED_BROKERS_FILE = "dedupe-brokers.txt"
#: bytes the file may grow past twice its size when last written whole before it is written whole again
_SLACK = 64 * 1024

_Seen = tuple[int, int, int, int, int]  # a file's device, inode, size, modification and change times


class ServedBrokers:
    """Target topic -> every broker seen serving it, kept in `path` (None: this process's memory only); thread-safe."""

    def __init__(self, path: Path | None) -> None:
        """Read what the file remembers (a missing file remembers nothing)."""
        self.path = path
        self._lock = threading.Lock()
        self._topics: dict[str, set[str]] = {}
        self._unsaved: dict[str, set[str]] = {}  # learnt and not yet in the file (a write failed, or it is unreadable)
        self.unreadable: str | None = None  # why the file cannot be read, until it can
        self.write_error: str | None = None  # why the last write failed, until one succeeds
        self._seen: _Seen | None = None  # the file as this process last read or wrote it (None: read it again)
        self._size = 0  # its bytes then
        self._compact = 0  # its bytes once written whole, as of then: the measure of when to write it whole again
        self._open_end = False  # its last line has no line break (written by hand): an append starts one
        self._watchers: list[Callable[[], None]] = []
        with self._lock:
            self._sync()

    def note(self, topic: str, brokers: Iterable[str]) -> None:
        """Remember that `brokers` serve `topic`; the file is written only when one of them is new."""
        self.note_all({topic: brokers})

    def note_all(self, topics: Mapping[str, Iterable[str]]) -> None:
        """`note` for many topics at once (one write of the file at most); the watchers are told if a broker was new."""
        with self._lock:
            learnt = False
            for topic, brokers in topics.items():
                known = self._topics.get(topic, ())
                new = {b for b in brokers if b not in known}
                if new:
                    learnt = True
                    self._topics.setdefault(topic, set()).update(new)
                    self._unsaved.setdefault(topic, set()).update(new)
            if not learnt:
                return
            self._sync()
            watchers = list(self._watchers)
        for on_new in watchers:  # after the topics hold it: a watcher that reads them finds it
            on_new()

    def watch(self, on_new: Callable[[], None]) -> None:
        """Call `on_new()` each time a broker new for some topic is noted, before that `note` returns
        (a replica set's holder publishes them to its standbys: `coordination._shared_brokers`)."""
        with self._lock:
            self._watchers.append(on_new)

    def snapshot(self) -> dict[str, set[str]]:
        """Target topic -> its brokers, as remembered now (the file read again: an operator may have edited it)."""
        with self._lock:
            self._sync()
            return {t: set(bs) for t, bs in self._topics.items()}

    def problems(self, topic: str, route: Collection[str]) -> list[str]:
        """Why `topic`'s keys cannot be called missing with only `route`'s brokers asked: each remembered
        broker the route does not list, or the file that cannot be read (none: the route is whole)."""
        with self._lock:
            if self.unreadable is None and self._topics.get(topic, set()) <= set(route):
                return []
            self._sync()  # an operator may have removed a broker gone for good, or mended the file
            if self.unreadable is not None:
                return [self.unreadable]
            forget = f"; if it is gone for good, delete its lines from {self.path}" if self.path is not None else ""
            return [f"broker {b} served {topic} and is not in its route now (down?): its copies cannot be asked "
                    f"about{forget}" for b in sorted(self._topics.get(topic, set()) - set(route))]

    def brokers(self) -> set[str]:
        """Every broker remembered for some topic."""
        with self._lock:
            return set().union(*self._topics.values()) if self._topics else set()

    def _sync(self) -> None:
        """Read the file again if it changed (an operator may have edited it), add what was learnt since,
        and append that to it (the caller holds the lock)."""
        if self.path is None:
            self._unsaved.clear()
            return
        try:
            stored = self._read(self.path)
        except (OSError, UnicodeDecodeError, BrokerRowsError) as e:
            self._seen = None
            if self.unreadable is None:
                log.error("%s cannot be read (%s): look-ups answer unknown until it is mended or deleted",
                          self.path, e)
            self.unreadable = (f"the brokers that served the target topics cannot be read from {self.path} ({e}): "
                               f"mend the file or delete it (then only the brokers in the route are asked)")
            return
        self.unreadable = None
        if stored is not None:  # read again: what it holds and what was learnt since
            merged = {t: set(bs) for t, bs in stored.items()}
            for t, bs in self._unsaved.items():
                merged.setdefault(t, set()).update(bs)
            self._topics = merged
            new = {t: left for t, bs in self._unsaved.items() if (left := bs - stored.get(t, set()))}
        else:  # as this process left it: nothing learnt since is in it
            new = {t: bs for t, bs in self._unsaved.items() if bs}
        if not new:
            self._unsaved.clear()
            return
        try:
            self._save(self.path, new)
        except OSError as e:  # still remembered by this process; written with the next broker noted
            self._seen = None  # a torn append is cut when the file is read again
            self.write_error = f"{self.path} could not be written: {e}"
            log.error("%s: a restart would not know the brokers learnt since", self.write_error)
            return
        self.write_error = None
        self._unsaved.clear()
        log.info("remembered in %s: %s", self.path.name,
                 "; ".join(f"{t} on {', '.join(sorted(bs))}" for t, bs in sorted(new.items())))

    def _read(self, path: Path) -> dict[str, set[str]] | None:
        """What the file holds (missing: nothing), or None when it is as this process last left it; a torn
        last line is cut from it."""
        try:
            seen = _seen(os.stat(path))
        except FileNotFoundError:
            self._seen = None
            return {}
        if seen == self._seen:
            return None
        data = path.read_bytes()
        kept, torn = cut_torn(data)
        stored = broker_topics_of(decode_broker_lines(kept.decode()))
        if torn:  # only once the rest reads: a file that does not is left as it is, for the operator
            log.warning("%s: cut the last line, torn by a crash inside an append before anything was sent "
                        "through it: %r", path, torn[:200])
            seen = _truncate(path, len(kept))
        self._seen, self._size, self._open_end = seen, len(kept), not kept.endswith(b"\n") and bool(kept)
        self._compact = len(encode_broker_lines(broker_rows_of(stored)).encode())
        return stored

    def _save(self, path: Path, new: dict[str, set[str]]) -> None:
        """Append `new` to the file, durably; or write what is known whole, if the file is not there or the
        append would take it past its bound."""
        lines = ("\n" if self._open_end else "") + encode_broker_lines(broker_rows_of(new), header=False)
        data = lines.encode()
        if self._seen is not None and self._size + len(data) <= 2 * self._compact + _SLACK:
            try:
                self._seen = _append(path, data)
                self._size += len(data)
                self._open_end = False
                return
            except FileNotFoundError:  # deleted since it was read: created whole below
                pass
        self._seen = None
        _write(path, self._topics)
        st = os.stat(path)
        self._seen, self._size, self._compact, self._open_end = _seen(st), st.st_size, st.st_size, False


def _seen(st: os.stat_result) -> _Seen:
    """What tells a file changed since it was last looked at."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _append(path: Path, data: bytes) -> _Seen:
    """Add `data` at the end of the existing file, durably; the file as left."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
        return _seen(os.fstat(fd))
    finally:
        os.close(fd)


def _truncate(path: Path, size: int) -> _Seen:
    """Cut the file to its first `size` bytes, durably; the file as left."""
    fd = os.open(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, size)
        os.fsync(fd)
        return _seen(os.fstat(fd))
    finally:
        os.close(fd)


def _write(path: Path, topics: dict[str, set[str]]) -> None:
    """Replace the file by one holding `topics`, one row a broker, durably (a crash leaves the old file or the
    new one)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(encode_broker_lines(broker_rows_of(topics)))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a power loss
    finally:
        os.close(fd)
