"""Typed storage errors: each says what was expected, what was found, and where."""
from __future__ import annotations


class StorageError(Exception):
    """Base class of every error raised by `storage`."""


class CorruptRecordError(StorageError):
    """Bytes that do not decode as a record: bad magic, version, length or CRC32C; or an intact
    record whose own due time is not the one its index entry says (then `record_due_ms` holds the
    record's, which the index, having no CRC, cannot outweigh)."""

    def __init__(self, reason: str, *, offset: int | None = None, path: str | None = None,
                 record_due_ms: int | None = None) -> None:
        where = ""
        if path is not None:
            where += f" in {path}"
        if offset is not None:
            where += f" at offset {offset}"
        super().__init__(f"corrupt record{where}: {reason}")
        self.reason = reason
        self.offset = offset
        self.path = path
        self.record_due_ms = record_due_ms


class InvalidRecordError(StorageError, ValueError):
    """A record refused before it is written (too large, bad field, delay past the maximum)."""


class DelayTooLongError(InvalidRecordError):
    """The due time lies further ahead than the store's configured maximum delay."""

    def __init__(self, due_ms: int, now_ms: int, max_delay_ms: int) -> None:
        super().__init__(
            f"due time {due_ms} is {due_ms - now_ms} ms ahead; the maximum delay is {max_delay_ms} ms "
            f"({max_delay_ms / 3_600_000:.0f} h); raise max_delay_ms or send it later"
        )
        self.due_ms = due_ms
        self.now_ms = now_ms
        self.max_delay_ms = max_delay_ms


class StoreClosedError(StorageError):
    """The store was used after `close()`."""


class SnapshotMovedError(StorageError):
    """A reader beside a running engine read files the engine has since moved on from (a checkpoint
    removed an ingest log file it was about to read): read again from a fresh view."""


class MetaStoreCorruptError(StorageError):
    """RocksDB found the meta store's files damaged (a block whose checksum fails, a table or manifest
    that does not parse): names the meta directory, the file RocksDB named (`file`; None when it named
    none) and RocksDB's own words (`detail`), and says what to do."""

    def __init__(self, meta_dir: str, file: str | None, detail: str) -> None:
        super().__init__(
            f"the meta store {meta_dir} is corrupt: RocksDB found damage in {file or 'one of its files'} ({detail}). "
            "Messages are not kept there (segments and dispatch logs: `timewheel inspect --verify` checks them), but "
            "its id index, business keys, done marks and documents cannot all be read. With [ha], rebuild this "
            "replica: stop it, move its whole data directory aside and start it on an empty one (docs/HA.md). "
            f"Without, stop the engine, move {meta_dir} aside and start it again: nothing delivered or cancelled is "
            "sent again, but the ids of what it stored so far are forgotten (docs/OPERATIONS.md, \"A corrupt meta "
            "store\", says what that costs)")
        self.meta_dir = meta_dir
        self.file = file
        self.detail = detail


class StorageWriteError(StorageError, OSError):
    """A write failed (disk full, I/O error); what the call wrote was cut back, nothing half-kept."""


class MetaStoreStoppedError(StorageWriteError):
    """RocksDB stopped taking the meta store's writes after one failed on the disk (full, or an I/O error):
    it takes none again until the store is reopened, so no retry in this process can succeed. Names the
    meta directory and RocksDB's words (`detail`), and says what to do."""

    def __init__(self, meta_dir: str, detail: str) -> None:
        super().__init__(
            f"the meta store {meta_dir} takes no more writes: RocksDB stopped them when one failed ({detail}), and "
            "takes them again only once the store is reopened. Free disk space, then restart the engine: nothing "
            "acknowledged is lost (a restart replays the ingest log since the last checkpoint; what was not "
            "acknowledged is read from the broker again)")
        self.meta_dir = meta_dir
        self.detail = detail
