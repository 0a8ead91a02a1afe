"""Which brokers served each target topic, remembered in the data directory across restarts.

The NameServer drops a broker from every route as soon as its connection closes, so a look-up made
right after the engine starts again, while a broker is down, cannot tell from the route alone that
the broker holds copies. The brokers seen serving a topic (in the delivery producer's routes and in
the look-ups' own) are kept here, and a look-up that finds one of them missing from the route now
leaves its keys unknown (`forwarder.copy_finder`).

The file, `<data_dir>/dedupe-brokers.txt`, is rewritten whole (written under a temporary name,
fsynced, renamed) only when a broker not yet remembered for a topic shows up: a route is looked up
at most every few seconds per topic, never per message. Its first line is a comment (`#`); each
other line is a JSON array: a broker name, then the target topics it served (its layout:
`storage.broker_rows`, docs/FORMAT.md). Nothing is ever
forgotten by itself: an operator removes a broker gone for good by deleting its line, which the
next look-up that misses it reads (docs/OPERATIONS.md). A file that cannot be read is left as it
is, and every look-up's keys stay unknown until it is mended or deleted.

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

__all__ = ["SERVED_BROKERS_FILE", "ServedBrokers"]

log = logging.getLogger("timewheel.dedupe")

#: the file in the engine's data directory
SERVED_BROKERS_FILE = "dedupe-brokers.txt"


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
            forget = f"; if it is gone for good, delete its line from {self.path}" if self.path is not None else ""
            return [f"broker {b} served {topic} and is not in its route now (down?): its copies cannot be asked "
                    f"about{forget}" for b in sorted(self._topics.get(topic, set()) - set(route))]

    def brokers(self) -> set[str]:
        """Every broker remembered for some topic."""
        with self._lock:
            return set().union(*self._topics.values()) if self._topics else set()

    def _sync(self) -> None:
        """Read the file again (an operator may have edited it), add what was learnt since, and write it
        back if that added anything (the caller holds the lock)."""
        if self.path is None:
            self._unsaved.clear()
            return
        try:
            stored = broker_topics_of(decode_broker_lines(self.path.read_text())) if self.path.exists() else {}
        except (OSError, UnicodeDecodeError, BrokerRowsError) as e:
            if self.unreadable is None:
                log.error("%s cannot be read (%s): look-ups answer unknown until it is mended or deleted",
                          self.path, e)
            self.unreadable = (f"the brokers that served the target topics cannot be read from {self.path} ({e}): "
                               f"mend the file or delete it (then only the brokers in the route are asked)")
            return
        self.unreadable = None
        merged = {t: set(bs) for t, bs in stored.items()}
        for t, bs in self._unsaved.items():
            merged.setdefault(t, set()).update(bs)
        self._topics = merged
        if merged == stored:
            self._unsaved.clear()
            return
        try:
            _write(self.path, merged)
        except OSError as e:  # still remembered by this process; written with the next broker noted
            self.write_error = f"{self.path} could not be written: {e}"
            log.error("%s: a restart would not know the brokers learnt since", self.write_error)
            return
        self.write_error = None
        self._unsaved.clear()
        log.info("remembered in %s: %s", self.path.name,
                 "; ".join(f"{t} on {', '.join(sorted(bs - stored.get(t, set())))}" for t, bs in sorted(merged.items())
                           if bs - stored.get(t, set())))


def _write(path: Path, topics: dict[str, set[str]]) -> None:
    """Replace the file by one holding `topics`, durably (a crash leaves the old file or the new one)."""
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
