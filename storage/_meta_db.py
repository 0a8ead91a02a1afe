"""The meta store's RocksDB handle: every read, scan and write goes through `MetaDb`, which raises
RocksDB's report of damage as `MetaStoreCorruptError`, a write refused on the disk as
`MetaStoreStoppedError`, and lets every other error through unchanged.

rocksdict raises a plain `Exception` carrying RocksDB's status text, which begins "Corruption:" for
damage (a block whose checksum fails, a table or manifest that does not parse). Its scans do not
raise at all: an iterator that meets an error is no longer valid, as at the end, and only its status
says why, so `keys_from` reads the status where the keys end.

A write (or flush) that fails on the disk ("IO error:", a full disk most often) sets RocksDB's
background error: every later write is refused with the same words, even once space is freed,
until the database is reopened (rocksdict offers neither `Resume()` nor the file manager that would
recover it in place). So such a failure is no passing fault: ingest stops at once on it (fail-stop,
`serve` exits 3, a restart recovers) instead of refusing every batch until `consume_refused_max_s`.
"""
from __future__ import annotations

import re
from typing import Any, Iterator, cast

import rocksdict

from storage.errors import MetaStoreCorruptError, MetaStoreStoppedError, StorageError

#: how RocksDB's status text of damage begins (`Status::Corruption`)
CORRUPTION = "Corruption:"
#: how RocksDB's status text of a failed file operation begins (`Status::IOError`)
IO_ERROR = "IO error:"


def corruption(e: Exception, meta_dir: str) -> MetaStoreCorruptError | None:
    """The typed error for RocksDB's report of damage in the meta store at `meta_dir`; None for any other."""
    text = str(e)
    if isinstance(e, StorageError) or not text.startswith(CORRUPTION):
        return None
    return MetaStoreCorruptError(meta_dir, damaged_file(text, meta_dir), text)


def stopped(e: Exception, meta_dir: str) -> MetaStoreStoppedError | None:
    """The typed error for a write RocksDB refused on the disk (its writes stop there); None for any other."""
    text = str(e)
    if isinstance(e, StorageError) or not text.startswith(IO_ERROR):
        return None
    return MetaStoreStoppedError(meta_dir, text)


def damaged_file(text: str, meta_dir: str) -> str | None:
    """The first file of the meta store RocksDB's text names (a table, a manifest, a log); None if none."""
    named = re.search(re.escape(meta_dir.rstrip("/")) + r"/[^\s:,]+", text) or re.search(r"[^\s:,]+\.sst\b", text)
    return named.group(0) if named else None


class MetaDb:
    """A rocksdict database (raw mode) whose damage is raised as `MetaStoreCorruptError`."""

    def __init__(self, db: rocksdict.Rdict, meta_dir: str) -> None:
        """Over an open database; `meta_dir` is the path it was opened at, as RocksDB names its files."""
        self._db = db
        self.meta_dir = meta_dir

    def _raise_if_corrupt(self, e: Exception) -> None:
        """Raise the typed error if `e` is RocksDB's report of damage (the caller re-raises any other)."""
        corrupt = corruption(e, self.meta_dir)
        if corrupt is not None:
            raise corrupt from e

    def _raise_typed(self, e: Exception) -> None:
        """Of a write's failure: raise the typed error for damage or for writes stopped (the caller re-raises
        any other)."""
        self._raise_if_corrupt(e)
        refused = stopped(e, self.meta_dir)
        if refused is not None:
            raise refused from e

    def get(self, key: bytes | list[bytes]) -> Any:
        """A value (None: no such key), or a list of them for a list of keys (one multi-get)."""
        try:
            return self._db.get(cast(Any, key))  # the stub's list of any key type: a list[bytes] is not one
        except Exception as e:
            self._raise_if_corrupt(e)
            raise

    def put(self, key: bytes, value: bytes, options: rocksdict.WriteOptions | None = None) -> None:
        """Store one value."""
        try:
            self._db.put(key, value, options)
        except Exception as e:
            self._raise_typed(e)
            raise

    def delete(self, key: bytes, options: rocksdict.WriteOptions | None = None) -> None:
        """Drop one key."""
        try:
            self._db.delete(key, options)
        except Exception as e:
            self._raise_typed(e)
            raise

    def write(self, batch: rocksdict.WriteBatch, options: rocksdict.WriteOptions | None = None) -> None:
        """Apply a write batch whole."""
        try:
            if options is None:
                self._db.write(batch)
            else:
                self._db.write(batch, options)
        except Exception as e:
            self._raise_typed(e)
            raise

    def keys_from(self, start: bytes, options: rocksdict.ReadOptions | None = None) -> Iterator[bytes]:
        """Keys in order from `start` (the caller stops where its prefix ends); damage met on the way is
        raised where it is met, never taken for the end of the keys."""
        return (key for key, _ in self._scan(start, options, values=False))

    def items(self) -> Iterator[tuple[bytes, bytes]]:
        """Every entry in key order, as `keys_from` reads them."""
        return self._scan(b"", None, values=True)

    def _scan(self, start: bytes, options: rocksdict.ReadOptions | None,
              values: bool) -> Iterator[tuple[bytes, bytes]]:
        """(key, value) in order from `start` (the value b"" unless `values`)."""
        it = self._db.iter(options) if options is not None else self._db.iter()
        try:
            it.seek(start)
            while it.valid():
                yield cast(bytes, it.key()), cast(bytes, it.value()) if values else b""
                it.next()
            it.status()  # raises what made the iterator stop, if it was not the end
        except Exception as e:
            del it  # kept by the error's traceback, it would hold the database open, and so its lock
            self._raise_if_corrupt(e)
            raise

    def property_int_value(self, name: str) -> int | None:
        """One of RocksDB's integer properties (None: not known)."""
        return self._db.property_int_value(name)

    def flush(self) -> None:
        """Flush the memtables to table files, then RocksDB's own log to disk."""
        try:
            self._db.flush()
            self._db.flush_wal(True)
        except Exception as e:
            self._raise_typed(e)
            raise

    def close(self) -> None:
        """Close the database; its files and lock go even when RocksDB reports an error (the flush of what
        was written without its log may meet the damage a compaction found, or writes stopped on the disk)."""
        try:
            self._db.close()
        except Exception as e:
            self._raise_typed(e)
            raise
