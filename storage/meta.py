"""The meta store (rocksdict): what must be found by key. Segment files stay the source of truth.

Keys (bytes):
    i<msg_id>                 -> location: segment_ms int64, part uint16, offset uint32 (14 bytes)
    k<key>\\x00<msg_id>        -> b""  (business key -> ids, by prefix scan)
    c<msg_id>                 -> cancel time, int64
    s<segment_ms big-endian>  -> segment state: b"done:" + the part numbers it held then (uint16 each,
                                 little-endian) when every record is dispatched or cancelled (cleared
                                 when a late record is stored in it, or a part it does not name is
                                 published into it: `storage.reopen`); b"done" alone from older builds
    m<name>                   -> JSON documents: checkpoints, traffic rules

Damage RocksDB finds in its files (a read, a scan, a write or the open meets it) is raised as
`MetaStoreCorruptError`, naming the file (`storage._meta_db`); `verify` reads everything through.
"""
from __future__ import annotations

import json
import os
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Sequence, cast

import rocksdict

from storage._meta_db import MetaDb, corruption
from storage.errors import StorageError

LOCATION = struct.Struct("<qHI")
_I64 = struct.Struct("<q")
_BE64 = struct.Struct(">q")
_DONE = b"done:"  # a done mark, before its part numbers
#: RocksDB's info log in the meta store's directory: files of at most this size, at most this many
INFO_LOG_BYTES = 1 << 20
INFO_LOG_FILES = 4
#: read-only opens tried while the engine's compactions keep removing the files just listed
_READ_ONLY_OPENS = 10
_MISSING = "No such file or directory"


@dataclass(frozen=True, slots=True)
class Location:
    """Where a record lives: its segment, part and byte offset."""

    segment_ms: int
    part: int
    offset: int


#: RocksDB's properties behind `MetaStore.memory_bytes`
_MEMORY_PROPERTIES = {"block_cache": "rocksdb.block-cache-usage", "memtables": "rocksdb.cur-size-all-mem-tables",
                      "table_readers": "rocksdb.estimate-table-readers-mem"}


class MetaStore:
    """Key lookups for ingest dedup, business keys, cancellations, segment states and documents."""

    @staticmethod
    def exists(path: str | os.PathLike[str]) -> bool:
        """Whether a meta store was ever made at `path` (an engine opened it): RocksDB's CURRENT file."""
        return os.path.isfile(os.path.join(path, "CURRENT"))

    def __init__(self, path: str | os.PathLike[str], *, read_only: bool = False,
                 block_cache_bytes: int | None = None) -> None:
        """Open (creating) the store; `read_only` opens it beside the engine that writes it, as it
        stood on disk: record locations the engine has not flushed yet (since its last checkpoint)
        are not seen, as they are kept only in the ingest log until then. `block_cache_bytes` sizes
        the cache of blocks read from its files (RocksDB's default, 32 MiB, when None)."""
        opts = rocksdict.Options(raw_mode=True)
        opts.create_if_missing(not read_only)
        table = rocksdict.BlockBasedOptions()
        table.set_bloom_filter(10, False)  # most ingest lookups are misses (new ids): answer them from the filter
        if block_cache_bytes is not None:
            table.set_block_cache(rocksdict.Cache(block_cache_bytes))
        opts.set_block_based_table_factory(table)
        # and those of the memtable too, where the ids of the last minutes are: a filter of whole keys
        # instead of a search of its skip list (1.4 -> 0.2 µs a missing id; an insert pays part of it back)
        opts.set_memtable_whole_key_filtering(True)
        opts.set_memtable_prefix_bloom_ratio(0.02)
        # RocksDB's own info log (LOG, and a LOG.old.* kept at every open) grows by every checkpoint's
        # flush and is never cut by default: about 10 KB a flush (86 MB a day at 10 s checkpoints),
        # one file more at every start
        opts.set_max_log_file_size(INFO_LOG_BYTES)
        opts.set_keep_log_file_num(INFO_LOG_FILES)
        self.read_only = read_only
        if read_only:
            # every table file opened at once: one the engine compacts away later stays readable
            # through its descriptor, where a file opened on first read would be gone
            opts.set_max_open_files(-1)
        for attempt in range(_READ_ONLY_OPENS):
            try:
                if read_only:
                    db = rocksdict.Rdict(str(path), opts, access_type=rocksdict.AccessType.read_only(False))
                else:
                    db = rocksdict.Rdict(str(path), opts)
                break
            except Exception as e:  # rocksdict raises plain Exception
                # beside a running engine: a table file named by the manifest just read was compacted
                # away before it was opened (RocksDB says "Corruption"); the next read of the manifest
                # no longer names it, and one still missing then is not called damage: it may be the race
                missing = read_only and _MISSING in str(e)
                if missing and attempt + 1 < _READ_ONLY_OPENS:
                    time.sleep(0.02 * (attempt + 1))
                    continue
                corrupt = None if missing else corruption(e, str(path))
                if corrupt is not None:  # before the lock's test: "block checksum mismatch" holds "lock"
                    raise corrupt from e
                if "lock" in str(e).lower():
                    raise StorageError(f"{path} is in use by another engine (its meta store is locked); "
                                       "stop it or use another data directory") from e
                raise StorageError(f"cannot open the meta store at {path}: {e}") from e
        self._db = MetaDb(db, str(path))
        # Record locations are replayed from the ingest log after a crash, and a checkpoint flushes
        # the memtables before it lets that log go, so rocksdb's own log would only write them twice.
        self._unlogged = rocksdict.WriteOptions()
        self._unlogged.disable_wal = True  # type: ignore[method-assign,assignment]  # a property; the stub says method
        self._synced = rocksdict.WriteOptions()
        self._synced.sync = True
        # the segments marked done, for `put_records` to see without a read; replaced whole under
        # the lock, so that a reader on another thread never iterates a set that changes
        self._done_lock = threading.Lock()
        try:
            self._done: frozenset[int] = frozenset(self.done_segments())
        except BaseException:  # the caller gets no store to close: its lock is let go here
            self._db.close()
            raise
        # the newest of them, or above (raised before a mark joins `_done`): a commit whose records all
        # lie in later segments, the usual one, is told so without a walk over every segment marked done
        self._done_top = max(self._done, default=-1)

    def memory_bytes(self) -> dict[str, int]:
        """What the meta store holds in memory, by kind: its block cache (up to RocksDB's default
        capacity, filled by look-ups), its memtables (emptied at each checkpoint's flush) and its
        table readers (indexes and filters of the files on disk)."""
        out = {}
        for kind, prop in _MEMORY_PROPERTIES.items():
            value = self._db.property_int_value(prop)
            out[kind] = int(value) if value is not None else 0
        return out

    def locations(self, msg_ids: Sequence[str]) -> list[Location | None]:
        """Locations of ids (None where unknown), in one multi-get."""
        if not msg_ids:
            return []
        raw = self._get_many(msg_ids)
        if raw.count(None) == len(raw):  # the usual batch: every id new
            return cast("list[Location | None]", raw)
        return [None if v is None else Location(*LOCATION.unpack(v)) for v in raw]

    def known(self, msg_ids: Sequence[str]) -> list[bool]:
        """Which ids are already stored."""
        if not msg_ids:
            return []
        return [v is not None for v in self._get_many(msg_ids)]

    def _get_many(self, msg_ids: Sequence[str]) -> list[bytes | None]:
        """Raw values of ids' location keys, in one multi-get."""
        return cast("list[bytes | None]", self._db.get(_id_keys(msg_ids)))

    def _keys_from(self, start: bytes) -> Iterator[bytes]:
        """Raw keys in order from `start` (the caller stops where its prefix ends)."""
        return self._db.keys_from(start)

    def verify(self) -> int:
        """Read every entry through, each block's checksum checked (what `check()` runs): how many there
        are; MetaStoreCorruptError at the first damage."""
        options = rocksdict.ReadOptions()
        options.set_verify_checksums(True)
        # a scan of everything would push out of the cache what look-ups read
        options.fill_cache(False)  # type: ignore[call-arg]  # it takes the flag; the stub says none
        return sum(1 for _ in self._db.keys_from(b"", options))

    def put_records(self, msg_ids: Sequence[str], segment_ms: Sequence[int], parts: Sequence[int],
                    offsets: Sequence[int], keys: Sequence[Sequence[str]]) -> None:
        """Record ids' locations and their business keys in one write batch."""
        wb = rocksdict.WriteBatch(raw_mode=True)
        pack = LOCATION.pack
        put = wb.put
        for key, seg, part, off in zip(_id_keys(msg_ids), segment_ms, parts, offsets):
            put(key, pack(seg, part, off))
        if any(keys):
            for mid, ks in zip(msg_ids, keys):
                if ks:
                    mb = mid.encode()
                    for k in ks:
                        put(b"k" + k.encode() + b"\x00" + mb, b"")
        done, top = self._done, self._done_top
        # A record stored in a segment marked done (one that arrived late) makes it pending again, in
        # the same batch: a start never loads a done segment, and the record would never be sent.
        # Unlogged like the ids: a crash loses both, and the replay of the ingest log writes both again.
        again = done.intersection(segment_ms) if done and min(segment_ms, default=top + 1) <= top else ()
        for seg in again:
            wb.delete(b"s" + _BE64.pack(seg))
        self._db.write(wb, self._unlogged)
        if again:
            self._undone(again)

    def ids_for_key(self, key: str, limit: int | None = None) -> list[str]:
        """Message ids stored under a business key (the first `limit`, in id order, when given)."""
        prefix = b"k" + key.encode() + b"\x00"
        out: list[str] = []
        for k in self._keys_from(prefix):
            if not k.startswith(prefix) or (limit is not None and len(out) >= limit):
                break
            out.append(k[len(prefix):].decode())
        return out

    def forget_records(self, msg_ids: Sequence[str], keys: Sequence[Sequence[str]]) -> list[int | None]:
        """Drop ids' locations, business keys and cancel marks (their segment is being retired), in one
        write batch; returns the cancel times dropped (None where there was none), for `restore_records`."""
        cancelled = [None if v is None else int(_I64.unpack(v)[0])
                     for v in cast("list[bytes | None]", self._db.get([b"c" + m.encode() for m in msg_ids]))]
        wb = rocksdict.WriteBatch(raw_mode=True)
        for mid, ks in zip(msg_ids, keys):
            mb = mid.encode()
            wb.delete(b"i" + mb)
            wb.delete(b"c" + mb)
            for k in ks:
                wb.delete(b"k" + k.encode() + b"\x00" + mb)
        self._db.write(wb)
        return cancelled

    def restore_records(self, msg_ids: Sequence[str], segment_ms: int, parts: Sequence[int], offsets: Sequence[int],
                        keys: Sequence[Sequence[str]], cancelled: Sequence[int | None]) -> None:
        """Put back what `forget_records` dropped of ids whose segment stayed, in one write batch."""
        wb = rocksdict.WriteBatch(raw_mode=True)
        for mid, part, off, ks, at in zip(msg_ids, parts, offsets, keys, cancelled):
            mb = mid.encode()
            wb.put(b"i" + mb, LOCATION.pack(segment_ms, part, off))
            if at is not None:
                wb.put(b"c" + mb, _I64.pack(at))
            for k in ks:
                wb.put(b"k" + k.encode() + b"\x00" + mb, b"")
        # synced: the forget before it may already be on disk (a memtable flush), and no ingest-log
        # replay brings these back, as it does the unlogged locations of new records
        self._db.write(wb, self._synced)

    def ids_with_prefix(self, prefix: str, limit: int = 1000) -> list[str]:
        """Stored message ids that start with `prefix`."""
        start = b"i" + prefix.encode()
        out: list[str] = []
        for k in self._keys_from(start):
            if not k.startswith(start) or len(out) >= limit:
                break
            out.append(k[1:].decode())
        return out

    def mark_cancelled(self, msg_ids: Iterable[str], at_ms: int) -> None:
        """Remember that ids were cancelled."""
        wb = rocksdict.WriteBatch(raw_mode=True)
        for m in msg_ids:
            wb.put(b"c" + m.encode(), _I64.pack(at_ms))
        self._db.write(wb)

    def is_cancelled(self, msg_id: str) -> bool:
        """Whether an id was cancelled."""
        return self._db.get(b"c" + msg_id.encode()) is not None

    def cancelled_at(self, msg_id: str) -> int | None:
        """When an id was cancelled (epoch ms), or None."""
        raw = self._db.get(b"c" + msg_id.encode())
        return None if raw is None else int(_I64.unpack(raw)[0])

    def mark_segment_done(self, segment_ms: int, parts: Sequence[int] = ()) -> None:
        """Remember that a segment has nothing left to dispatch, with the parts it was read from (a part
        published since makes it pending again, as `put_records` storing one in it does)."""
        self._db.put(b"s" + _BE64.pack(segment_ms), _DONE + struct.pack(f"<{len(parts)}H", *sorted(parts)))
        with self._done_lock:
            self._done_top = max(self._done_top, segment_ms)
            self._done = self._done.union((segment_ms,))

    def done_now(self) -> frozenset[int]:
        """The segments marked done, as this process knows them (no read)."""
        return self._done

    def done_parts(self, segments: Sequence[int]) -> dict[int, tuple[int, ...] | None]:
        """Of these segments, those marked done, with the parts their marks name (None: a mark of an
        older build, which named none)."""
        out: dict[int, tuple[int, ...] | None] = {}
        raw = cast("list[bytes | None]", self._db.get([b"s" + _BE64.pack(s) for s in segments])) if segments else []
        for seg, value in zip(segments, raw):
            if value is not None:
                body = value[len(_DONE):]
                out[seg] = struct.unpack(f"<{len(body) // 2}H", body) if value.startswith(_DONE) else None
        return out

    def done_segments(self) -> set[int]:
        """Segments known to have nothing left to dispatch."""
        out: set[int] = set()
        for k in self._keys_from(b"s"):
            if not k.startswith(b"s"):
                break
            out.add(_BE64.unpack(k[1:9])[0])
        return out

    def forget_segment(self, segment_ms: int, *, sync: bool = False) -> None:
        """Drop a segment's state: it was retired, or is pending again; with `sync`, durably (and every
        write before it: retention drops a segment's mark, after its records' entries, before its files)."""
        self._db.delete(b"s" + _BE64.pack(segment_ms), self._synced if sync else None)
        self._undone((segment_ms,))

    def _undone(self, segments: Iterable[int]) -> None:
        """Drop segments from those known done (their marks are gone from the database)."""
        with self._done_lock:
            self._done = self._done.difference(segments)
            self._done_top = max(self._done, default=-1)  # a walk, but only as a mark goes

    def get_document(self, name: str) -> Any | None:
        """A JSON document stored under `name`, or None."""
        raw = self._db.get(b"m" + name.encode())
        return None if raw is None else json.loads(raw)

    def put_document(self, name: str, value: Any, *, sync: bool = False) -> None:
        """Store a JSON document under `name`; with `sync`, durably before it returns."""
        self._db.put(b"m" + name.encode(), json.dumps(value).encode(), self._synced if sync else None)

    def flush(self) -> None:
        """Flush memtables and the store's own log to disk."""
        self._db.flush()

    def close(self) -> None:
        """Close the store."""
        self._db.close()


def _id_keys(msg_ids: Sequence[str]) -> list[bytes]:
    """The location key (`i<msg_id>`) of each id, built by one join and one split: a key a message
    costs no Python call of its own. Ids holding NUL, which the split would cut, take the plain way."""
    keys = ("i" + "\x00i".join(msg_ids)).encode().split(b"\x00")
    if len(keys) == len(msg_ids):
        return keys
    return [b"i" + m.encode() for m in msg_ids]
