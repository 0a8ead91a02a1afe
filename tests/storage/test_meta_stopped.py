"""A write RocksDB refuses on the disk stops its writes until the store is reopened (a full disk that is
freed later included): `MetaStoreStoppedError`, which ingest takes as no passing fault, and which says to
free space and restart."""
from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest

from storage import MetaStore, MetaStoreStoppedError, Record, ScheduleStore, StorageWriteError
from storage._meta_db import MetaDb
from tests.storage._meta_damage import NOW

NO_SPACE = "IO error: No space left on device: While appending to file: /d/meta/000011.sst: No space left on device"


class _Refusing:
    """A rocksdict stand-in whose every call raises RocksDB's words for a write the disk refused."""

    def __getattr__(self, name: str) -> Any:
        def refuse(*args: object) -> None:
            raise Exception(NO_SPACE)
        return refuse


@pytest.mark.parametrize("call", ["put", "delete", "write", "flush"])
def test_a_write_refused_on_the_disk_is_raised_as_writes_stopped(call: str) -> None:
    db = MetaDb(_Refusing(), "/d/meta")  # type: ignore[arg-type]
    args: dict[str, tuple[object, ...]] = {"put": (b"k", b"v"), "delete": (b"k",), "write": (object(),), "flush": ()}
    with pytest.raises(MetaStoreStoppedError) as raised:
        getattr(db, call)(*args[call])
    assert isinstance(raised.value, StorageWriteError), "handlers of a failed write still take it"
    assert raised.value.meta_dir == "/d/meta" and raised.value.detail == NO_SPACE
    assert "Free disk space, then restart the engine" in str(raised.value)


def test_a_read_that_fails_so_is_passed_as_it_was() -> None:
    with pytest.raises(Exception) as raised:
        MetaDb(_Refusing(), "/d/meta").get(b"k")  # type: ignore[arg-type]
    assert not isinstance(raised.value, StorageWriteError) and str(raised.value) == NO_SPACE


@contextlib.contextmanager
def _small_disk(path: Path, mb: int) -> Iterator[Path]:
    """A tmpfs of `mb` MB mounted at `path` (root only)."""
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mb}m", "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        path.rmdir()
        pytest.skip(f"cannot mount a small disk here (root only): {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def _fill(path: Path) -> None:
    """Write `path`'s file system full."""
    with contextlib.suppress(OSError), open(path / "filler", "wb") as f:
        while True:
            f.write(b"\0" * (1 << 16))
            f.flush()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small disk needs root")
def test_rocksdb_takes_no_write_after_a_full_disk_even_once_space_is_freed(tmp_path: Path) -> None:
    """The premise, on a real RocksDB and a real full disk: the refusal sticks after the space comes back,
    and a reopen ends it."""
    with _small_disk(tmp_path / "disk", 16) as disk:
        meta = MetaStore(disk / "meta")
        try:
            meta.put_document("before", {"n": 1})
            _fill(disk)
            with pytest.raises(MetaStoreStoppedError) as full:
                for i in range(64):  # the write and the flush of its memtable need room
                    meta.put_document(f"doc{i}", {"pad": "x" * 4096})
                    meta.flush()
            assert "No space left on device" in full.value.detail
            (disk / "filler").unlink()
            with pytest.raises(MetaStoreStoppedError):
                meta.put_document("after", {"n": 2})  # space is back: RocksDB still refuses
            assert meta.get_document("before") == {"n": 1}, "reads go on"
        finally:
            with contextlib.suppress(Exception):
                meta.close()
        reopened = MetaStore(disk / "meta")
        try:
            reopened.put_document("after", {"n": 2})
            assert reopened.get_document("after") == {"n": 2}
        finally:
            reopened.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small disk needs root")
def test_an_append_on_a_store_whose_meta_writes_stopped_keeps_nothing_and_says_restart(tmp_path: Path) -> None:
    with _small_disk(tmp_path / "disk", 32) as disk:
        store = ScheduleStore(disk / "data")
        try:
            store.append([Record("m0", "ORDERS", b"x", NOW + 5_000)], NOW)
            seg = store.layout.segment_start(NOW)
            _fill(disk)
            with pytest.raises(StorageWriteError):
                for i in range(64):
                    store.meta.put_document(f"doc{i}", {"pad": "x" * 4096})
                    store.meta.flush()
            (disk / "filler").unlink()
            before = (list(store.segment_index(seg).offset), store._wal.seq, store._wal.position)
            with pytest.raises(MetaStoreStoppedError, match="restart the engine"):
                store.append([Record("m1", "ORDERS", b"x", NOW + 6_000)], NOW)
            assert (list(store.segment_index(seg).offset), store._wal.seq, store._wal.position) == before
        finally:
            with contextlib.suppress(Exception):
                store.close()
        with ScheduleStore(disk / "data") as again:  # a restart: writes go again, the refused one was not kept
            assert again.meta.known(["m0", "m1"]) == [True, False]
            again.append([Record("m1", "ORDERS", b"x", NOW + 6_000)], NOW)
            assert again.meta.known(["m1"]) == [True]
