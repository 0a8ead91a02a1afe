"""An in-memory heap delay engine, the way Pulsar's in-memory delayed-delivery tracker works.

Messages are appended to a log (Pulsar: the topic's ledger); the engine keeps only
`(due_ms, log offset)` per pending message in a `heapq`, and one release thread waits on a
condition variable until the earliest is due, pops every due entry, reads each body back from the
log and hands it on. Releases are appended to an ack log (Pulsar: the cursor). A restart rebuilds
the heap by reading the whole log and skipping acknowledged ids, as Pulsar's tracker is rebuilt by
replaying the backlog.

Log record: `<q due_ms><q id><I body length>` then the body. Ack log: one `<q id>` per release.

`python -m bench.peers.heap_engine --log-dir DIR` is the restart measurement: it rebuilds from DIR,
waits for the first release and prints one JSON line (RSS before and after the rebuild, pending
count, rebuild seconds, epoch ns of the first release).
"""
from __future__ import annotations

import argparse
import heapq
import json
import os
import struct
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

_HEADER = struct.Struct("<qqI")  # due_ms, id, body length
_ACK = struct.Struct("<q")

#: Called for each released message: (id, due_ms, body).
Release = Callable[[int, int, bytes], None]


class HeapEngine:
    """A heap of `(due_ms, offset)` and a release thread; bodies stay in the append-only log."""

    def __init__(self, log_dir: Path, release: Release) -> None:
        """Open (or create) the logs in `log_dir`; call rebuild() to take over what they hold."""
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_dir / "messages.log", "ab")
        self._reader = os.open(self.log_dir / "messages.log", os.O_RDONLY)
        self._acks = open(self.log_dir / "acks.log", "ab")
        self._release = release
        self._heap: list[tuple[int, int]] = []
        self._cond = threading.Condition()
        self._running = False
        self._thread: threading.Thread | None = None
        self.released = 0

    def rebuild(self) -> int:
        """Load every logged, unacknowledged message into the heap; return how many."""
        acked = set(np.fromfile(self.log_dir / "acks.log", dtype="<i8").tolist())
        data = (self.log_dir / "messages.log").read_bytes()
        entries: list[tuple[int, int]] = []
        pos, end, size = 0, len(data), _HEADER.size
        unpack = _HEADER.unpack_from
        while pos + size <= end:
            due, msg_id, n = unpack(data, pos)
            if pos + size + n > end:
                break  # a torn tail: the write never completed
            if msg_id not in acked:
                entries.append((due, pos))
            pos += size + n
        heapq.heapify(entries)
        with self._cond:
            self._heap = entries
            self._cond.notify()
        return len(entries)

    def start(self) -> HeapEngine:
        """Start the release thread."""
        self._running = True
        self._thread = threading.Thread(target=self._run, name="heap-release", daemon=True)
        self._thread.start()
        return self

    def schedule(self, messages: Sequence[tuple[int, int, bytes]]) -> None:
        """Log and schedule `(id, due_ms, body)` messages (the log write is not fsynced)."""
        chunks, offsets = [], []
        pos = 0
        for msg_id, due, body in messages:
            offsets.append((due, pos))
            chunks.append(_HEADER.pack(due, msg_id, len(body)))
            chunks.append(body)
            pos += _HEADER.size + len(body)
        with self._cond:
            base = self._log.tell()  # under the lock: concurrent schedulers append one after another
            offsets = [(due, base + off) for due, off in offsets]
            self._log.write(b"".join(chunks))
            self._log.flush()  # to the OS: readable by pread, survives a crash of this process
            earliest = self._heap[0][0] if self._heap else None
            for entry in offsets:
                heapq.heappush(self._heap, entry)
            if earliest is None or self._heap[0][0] < earliest:
                self._cond.notify()

    def __len__(self) -> int:
        """Pending messages."""
        return len(self._heap)

    def _run(self) -> None:
        """Wait for the earliest due time, pop everything due, release it outside the lock."""
        while True:
            with self._cond:
                while True:
                    if not self._running:
                        return
                    if self._heap:
                        wait_ms = self._heap[0][0] - time.time_ns() / 1e6
                        if wait_ms <= 0:
                            break
                        self._cond.wait(wait_ms / 1000)
                    else:
                        self._cond.wait()
                now = time.time_ns() // 1_000_000
                due: list[tuple[int, int]] = []
                while self._heap and self._heap[0][0] <= now and len(due) < 1024:
                    due.append(heapq.heappop(self._heap))
            acks = []
            for _due, offset in due:
                header = os.pread(self._reader, _HEADER.size, offset)
                d, msg_id, n = _HEADER.unpack(header)
                body = os.pread(self._reader, n, offset + _HEADER.size)
                self._release(msg_id, d, body)
                acks.append(_ACK.pack(msg_id))
            self._acks.write(b"".join(acks))
            self._acks.flush()
            self.released += len(due)

    def close(self) -> None:
        """Stop the release thread and close the logs."""
        with self._cond:
            self._running = False
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(10)
        self._log.close()
        self._acks.close()
        os.close(self._reader)


def write_log(log_dir: Path, ids: np.ndarray, dues: np.ndarray, body: bytes) -> int:
    """Append messages to a log without an engine (a producer writing while the engine is down)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    rec = np.dtype([("due", "<i8"), ("id", "<i8"), ("n", "<u4"), ("body", f"V{len(body)}")])
    arr = np.zeros(len(ids), dtype=rec)
    arr["due"], arr["id"], arr["n"] = dues, ids, len(body)
    arr["body"] = np.frombuffer(body, dtype=f"V{len(body)}")[0] if body else arr["body"]
    with open(log_dir / "messages.log", "ab") as f:
        f.write(arr.tobytes())
    return int(arr.nbytes)


def _rss() -> int:
    """This process's resident bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main(argv: Sequence[str] | None = None) -> None:
    """Rebuild from a log directory, wait for the first release, print one JSON line."""
    ap = argparse.ArgumentParser(prog="python -m bench.peers.heap_engine", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--log-dir", type=Path, required=True)
    ap.add_argument("--timeout", type=float, default=120.0)
    args = ap.parse_args(argv)
    first = threading.Event()
    first_ns: list[int] = []

    def on_release(msg_id: int, due_ms: int, body: bytes) -> None:
        if not first_ns:
            first_ns.append(time.time_ns())
            first.set()

    rss0 = _rss()
    engine = HeapEngine(args.log_dir, on_release)
    t0 = time.perf_counter()
    pending = engine.rebuild()
    rebuild_s = time.perf_counter() - t0
    rss1 = _rss()
    engine.start()
    first.wait(args.timeout)
    engine.close()
    print(json.dumps({"pending": pending, "rss_before": rss0, "rss_after": rss1, "rebuild_s": round(rebuild_s, 3),
                      "first_release_ns": first_ns[0] if first_ns else None}), flush=True)


if __name__ == "__main__":
    main()
