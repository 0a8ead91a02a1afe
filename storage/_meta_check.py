"""`check()`'s look at the meta store: opened read-only (so beside a running engine too) and read
through, every block's checksum checked (`MetaStore.verify`)."""
from __future__ import annotations

import os
from pathlib import Path

from storage.errors import MetaStoreCorruptError, StorageError
from storage.meta import MetaStore


def meta_store_findings(meta_dir: Path) -> list[tuple[str, str, str]]:
    """(kind, path, detail) of what is wrong with the meta store at `meta_dir`: `corrupt_meta_store`
    naming the file RocksDB found damaged, or `unreadable`; none when no engine has made one there."""
    try:
        os.stat(meta_dir / "CURRENT")
    except FileNotFoundError:
        return []  # `timewheel init` makes none: the first engine to open the directory does
    except OSError as e:  # not a directory, not this user's to read
        return [("unreadable", str(e.filename or meta_dir), f"cannot be read: {e.strerror or e}")]
    try:
        meta = MetaStore(meta_dir, read_only=True)
        try:
            meta.verify()
        finally:
            meta.close()
    except MetaStoreCorruptError as e:
        return [("corrupt_meta_store", e.file or e.meta_dir,
                 f"{e.detail}; its ids, business keys and documents cannot be read whole (docs/OPERATIONS.md, "
                 "\"A corrupt meta store\", says what to do)")]
    except StorageError as e:
        return [("unreadable", str(meta_dir), str(e))]
    return []
