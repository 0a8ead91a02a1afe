"""A data directory the storage layer wrote, and damage to its meta store's table files (RocksDB's .sst),
as a failing disk leaves it: bytes flipped in place, every file still there and of its size."""
from __future__ import annotations

from pathlib import Path

from storage import MetaStore, Record, ScheduleStore
from storage.dispatch import DELIVERED, dispatch_entries

NOW = 1_795_460_400_000  # 2026-11-23 19:00 UTC
#: where the first data block of a table file lies whatever its size: it starts at byte 0, and the
#: smallest one here (one document) is about 50 bytes
DATA_BLOCK_BYTES = range(8, 24)
#: what a table file ends with and RocksDB reads first at open (magic number, block handles)
FOOTER_BYTES = 64


def stored(tmp_path: Path) -> Path:
    """A data directory holding three messages under key "k" (m0 delivered), its meta store flushed to
    table files by the close."""
    d = tmp_path / "data"
    with ScheduleStore(d) as store:
        store.append([Record(f"m{i}", "ORDERS", b"x", NOW + 5_000 + i, keys=("k",)) for i in range(3)], NOW)
        seg_ms = store.layout.segment_start(NOW)
        idx = store.segment_index(seg_ms)
        store.record_dispatch(seg_ms, dispatch_entries(idx.part[:1], idx.offset[:1], idx.due_ms[:1], NOW, DELIVERED),
                              NOW)
    return d


def tables(data_dir: Path) -> list[Path]:
    """The meta store's table files, oldest first."""
    return sorted((data_dir / "meta").glob("*.sst"))


def flip(path: Path, where: range) -> None:
    """Invert the bytes of `path` at `where`, in place."""
    raw = bytearray(path.read_bytes())
    for i in where:
        raw[i] ^= 0xFF
    path.write_bytes(bytes(raw))


def damage_data_blocks(data_dir: Path) -> list[Path]:
    """Damage the first data block of every table file: the store opens, a read of what it held fails."""
    found = tables(data_dir)
    assert found, "the meta store was not flushed to table files"
    for t in found:
        flip(t, DATA_BLOCK_BYTES)
    return found


def damage_tables_whole(data_dir: Path) -> list[Path]:
    """Damage every table file but its footer: the blocks RocksDB reads when it opens a table fail."""
    found = tables(data_dir)
    assert found, "the meta store was not flushed to table files"
    for t in found:
        flip(t, range(0, t.stat().st_size - FOOTER_BYTES))
    return found


def damage_one_document(data_dir: Path, name: str, value: object) -> Path:
    """Store the document `name` in a table file of its own (the store closed after), then damage that
    table's first data block: the store opens, and only what reads the document, or a compaction of that
    table, meets the damage. Returns the table."""
    before = set(tables(data_dir))
    meta = MetaStore(data_dir / "meta")
    meta.put_document(name, value)
    meta.flush()
    meta.close()
    (table,) = set(tables(data_dir)) - before
    flip(table, DATA_BLOCK_BYTES)
    return table
