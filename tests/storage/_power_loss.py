"""A model of what a power loss leaves of the files a `ScheduleStore` writes itself.

Of a file, the power loss keeps its content at its last fsync (or fdatasync); of a directory, its
entries at its last fsync. A name created, renamed or linked into a directory not fsynced since is
gone; a name removed from one not fsynced since comes back, holding what its file held at its last
fsync. Files are told apart by identity (their inode, followed across renames and links, and not
confused with a new file that reuses a freed inode number), never by name.

Every fsync the store makes goes through `os.fsync` or `os.fdatasync` (file objects' too: the store
calls `os.fsync(f.fileno())`), so the model reads a file's content, or a directory's entries, at
each of those calls. The calls that free an inode (`os.unlink`, `os.remove`, `os.rmdir`,
`os.replace`, `os.rename`, and `shutil.rmtree` through them) are watched so that a reused inode
number is a new file, and `os.write` for the sizes it leaves a file at (lenient images, below).
Writes through file objects are not seen one by one: such a file is found at its durable content,
or at its content at the cut. The real disk is never synced (the model says what survives).

A lenient image adds what the kernel may have written back on its own before the power went: a
directory's later entries (all of them or none, per directory); of a file appended to since its
last fsync, its size as one of the later `os.write` calls left it, with the data up to it
(`Flavour.ORDERED`, ext4's default) or with zeros from some sector on, where the size reached the
disk and the data did not (`Flavour.WRITEBACK`); of a file cut and written again, its later content
whole or not at all.

The meta store (RocksDB) writes its files from C++, out of this model's sight. An image takes it as
a copy of its directory, either as it is at the cut (what a killed process leaves: RocksDB's own log
holds every logged write; unlogged memtable writes are lost) or as it was at its last sync point
(a flush, or a synced write: only what RocksDB was told to make durable).
"""
from __future__ import annotations

import enum
import itertools
import os
import random
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from storage.meta import MetaStore

#: RocksDB's info logs: not needed to open it, and rewritten at every event
_INFO_LOG = "LOG"


class Flavour(enum.Enum):
    """How much of what was not fsynced an image lets through."""

    STRICT = "strict"  # nothing
    ORDERED = "ordered"  # a later size, with its data
    WRITEBACK = "writeback"  # a later size, zeros where its data did not make it


#: what a disk writes whole: data past the last fsync is lost in these units, from a boundary on
SECTOR = 512


@dataclass(frozen=True, slots=True)
class Image:
    """What the disk holds right after the power went at one cut."""

    label: str
    root: int
    dirs: dict[int, dict[str, int]]
    contents: dict[int, bytes]
    is_dir: frozenset[int]
    current_dirs: dict[int, dict[str, int]]
    current_contents: dict[int, bytes]
    #: per file, the sizes `os.write` calls left it at since its last fsync
    write_ends: dict[int, frozenset[int]]
    meta_now: Path | None
    meta_synced: Path | None
    mark: Any


@dataclass(slots=True)
class DiskModel:
    """The durable state of one data directory (its meta store aside), kept up to date by the
    patched calls while this model is the active one (`watching`)."""

    root: Path
    work: Path
    #: called before each sync point takes effect, with a label; it may call `image`
    on_cut: Callable[[str], None] | None = None
    _fids: Iterator[int] = field(default_factory=itertools.count)
    _by_ino: dict[int, int] = field(default_factory=dict)
    _zombies: dict[int, int] = field(default_factory=dict)
    _is_dir: set[int] = field(default_factory=set)
    dirs: dict[int, dict[str, int]] = field(default_factory=dict)
    contents: dict[int, bytes] = field(default_factory=dict)
    write_ends: dict[int, set[int]] = field(default_factory=dict)
    meta_synced: Path | None = None
    syncs: int = 0
    _root_fid: int = -1
    _dev: int = -1
    _busy: bool = False

    def __post_init__(self) -> None:
        self.root = self.root.resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        st = os.stat(self.root)
        self._dev = st.st_dev
        self._root_fid = self._fid(st)
        self.dirs[self._root_fid] = {}

    @property
    def meta_dir(self) -> Path:
        """The meta store's directory (out of the model: copied whole)."""
        return self.root / "meta"

    # ---- identities -----------------------------------------------------------------------------

    def _fid(self, st: os.stat_result) -> int:
        """The identity of the file or directory `st` describes."""
        ino = st.st_ino
        if st.st_nlink == 0 and not stat.S_ISDIR(st.st_mode):  # removed, still open
            fid = self._zombies.get(ino)
            if fid is None:
                fid = self._zombies[ino] = next(self._fids)
            return fid
        fid = self._by_ino.get(ino)
        if fid is None:
            self._zombies.pop(ino, None)
            fid = self._by_ino[ino] = next(self._fids)
            if stat.S_ISDIR(st.st_mode):
                self._is_dir.add(fid)
        return fid

    def freed(self, st: os.stat_result | None) -> None:
        """A name of `st` went: if it was its last, a new file may take its inode number."""
        if st is None or st.st_dev != self._dev:
            return
        if stat.S_ISDIR(st.st_mode) or st.st_nlink <= 1:
            fid = self._by_ino.pop(st.st_ino, None)
            if fid is not None and not stat.S_ISDIR(st.st_mode):
                self._zombies[st.st_ino] = fid

    def _in_model(self, path: str) -> bool:
        p = path.removesuffix(" (deleted)")
        root, meta = str(self.root), str(self.meta_dir)
        return (p == root or p.startswith(root + os.sep)) and not (p == meta or p.startswith(meta + os.sep))

    def _entries(self, path: str) -> dict[str, int]:
        out = {}
        with os.scandir(path) as it:
            for e in it:
                out[e.name] = self._fid(e.stat(follow_symlinks=False))
        return out

    # ---- the watched calls ----------------------------------------------------------------------

    def synced(self, fd: int, what: str) -> None:
        """`fd` is about to be fsynced: what it holds becomes durable."""
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return
        if not self._in_model(path):
            return
        self._cut(f"{what} {os.path.relpath(path.removesuffix(' (deleted)'), self.root)}")
        st = os.fstat(fd)
        fid = self._fid(st)
        if stat.S_ISDIR(st.st_mode):
            self.dirs[fid] = self._entries(f"/proc/self/fd/{fd}")
        else:
            with open(f"/proc/self/fd/{fd}", "rb") as f:
                self.contents[fid] = f.read()
            self.write_ends.pop(fid, None)
        self.syncs += 1

    def written(self, fd: int) -> None:
        """An `os.write` to `fd` returned: a size the file may be found at after a power loss."""
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return
        if self._in_model(path):
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode):
                self.write_ends.setdefault(self._fid(st), set()).add(st.st_size)

    def meta_sync_point(self, what: str) -> None:
        """RocksDB made everything written to it so far durable (a flush or a synced write)."""
        self.syncs += 1
        self.meta_synced = self.copy_meta()

    def _cut(self, label: str) -> None:
        if self.on_cut is not None and not self._busy:
            self._busy = True
            try:
                self.on_cut(label)
            finally:
                self._busy = False

    def before_meta_sync(self, what: str) -> None:
        """A cut just before the meta store syncs."""
        self._cut(f"meta {what}")

    # ---- images ---------------------------------------------------------------------------------

    def copy_meta(self) -> Path | None:
        """A copy of the meta store's directory as it is now (None: there is none yet)."""
        if not self.meta_dir.is_dir():
            return None
        dst = Path(tempfile.mkdtemp(prefix="meta-", dir=self.work))
        for _ in range(20):  # its background compactions may swap files under the copy: copy again
            shutil.rmtree(dst)
            before = _listing(self.meta_dir)
            try:
                shutil.copytree(self.meta_dir, dst, ignore=shutil.ignore_patterns(_INFO_LOG + "*"))
            except (FileNotFoundError, shutil.Error):
                continue
            if _listing(self.meta_dir) == before:
                return dst
        raise RuntimeError(f"could not copy {self.meta_dir}: its files kept changing")

    def image(self, label: str, mark: Any, *, lenient: bool = True) -> Image:
        """The disk as a power loss now would leave it (`mark`: the caller's own note of what was
        acknowledged by then)."""
        cur_dirs: dict[int, dict[str, int]] = {}
        cur_contents: dict[int, bytes] = {}
        if lenient:
            for dirpath, dirnames, filenames in os.walk(self.root):
                if dirpath == str(self.meta_dir):
                    dirnames[:] = []
                    continue
                fid = self._fid(os.stat(dirpath))
                cur_dirs[fid] = self._entries(dirpath)
                for name in filenames:
                    path = os.path.join(dirpath, name)
                    child = self._fid(os.stat(path))
                    data = Path(path).read_bytes()
                    if self.contents.get(child) != data:
                        cur_contents[child] = data
        ends = {fid: frozenset(e) for fid, e in self.write_ends.items()} if lenient else {}
        return Image(label, self._root_fid, dict(self.dirs), dict(self.contents), frozenset(self._is_dir),
                     cur_dirs, cur_contents, ends, self.copy_meta(), self.meta_synced, mark)

    def everything_durable(self) -> None:
        """Take what the directory holds now as durable (a model started on a disk as found)."""
        for dirpath, dirnames, filenames in os.walk(self.root):
            if dirpath == str(self.meta_dir):
                dirnames[:] = []
                continue
            self.dirs[self._fid(os.stat(dirpath))] = self._entries(dirpath)
            for name in filenames:
                path = os.path.join(dirpath, name)
                self.contents[self._fid(os.stat(path))] = Path(path).read_bytes()
        self.meta_synced = self.copy_meta()


def _listing(path: Path) -> list[tuple[str, int]]:
    out = []
    for e in os.scandir(path):
        if not e.name.startswith(_INFO_LOG):
            try:
                out.append((e.name, e.stat().st_size))
            except FileNotFoundError:  # compacted away meanwhile: the listings differ, and the copy is made again
                out.append((e.name, -1))
    return sorted(out)


def materialize(image: Image, dest: Path, flavour: Flavour = Flavour.STRICT, rng: random.Random | None = None, *,
                meta: str = "now") -> None:
    """Write the disk `image` holds to the new directory `dest`, with what else of it `flavour`
    lets through (picked with `rng`). `meta`: the meta store as at the cut ("now") or as at its
    last sync point ("synced")."""
    if flavour is not Flavour.STRICT and rng is None:
        raise ValueError("a lenient flavour picks what got through with an rng")
    dest.mkdir(parents=True)
    _build(image, image.root, dest, flavour, rng, top=True)
    src = image.meta_now if meta == "now" else image.meta_synced
    if (dest / "meta").is_dir() and src is not None:
        shutil.copytree(src, dest / "meta", dirs_exist_ok=True)


def _build(image: Image, fid: int, dest: Path, flavour: Flavour, rng: random.Random | None,
           top: bool = False) -> None:
    entries = image.dirs.get(fid, {})
    if rng is not None and flavour is not Flavour.STRICT and fid in image.current_dirs and rng.random() < 0.5:
        entries = image.current_dirs[fid]  # this directory's later changes all reached the disk
    for name, child in entries.items():
        path = dest / name
        if top and name == "meta":
            path.mkdir()
        elif child in image.is_dir:
            path.mkdir()
            _build(image, child, path, flavour, rng)
        else:
            path.write_bytes(_content(image, child, flavour, rng))


def _content(image: Image, fid: int, flavour: Flavour, rng: random.Random | None) -> bytes:
    durable = image.contents.get(fid, b"")
    current = image.current_contents.get(fid)
    if rng is None or flavour is Flavour.STRICT or current is None:
        return durable
    if not current.startswith(durable):  # cut and written again: either whole
        return rng.choice([durable, current])
    sizes = sorted({len(durable), len(current)}
                   | {e for e in image.write_ends.get(fid, ()) if len(durable) <= e <= len(current)})
    end = rng.choice(sizes)
    if flavour is Flavour.WRITEBACK:
        lost_from = min(end, -(-rng.randint(len(durable), end) // SECTOR) * SECTOR)
        return current[:lost_from] + bytes(end - lost_from)
    return current[:end]


# ---- the patched calls ------------------------------------------------------------------------


class Watch:
    """The patched os calls, feeding whichever model is active."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.active: DiskModel | None = None
        real = {name: getattr(os, name) for name in ("fsync", "fdatasync", "unlink", "remove", "rmdir", "replace",
                                                     "rename", "write")}
        self._real = real

        def sync_of(name: str) -> Callable[[int], None]:
            def sync(fd: int) -> None:
                # what survives is the model's to say: the real disk is never waited for
                if self.active is not None:
                    self.active.synced(fd, name)
            return sync

        def write(fd: int, data: Any) -> int:
            n: int = real["write"](fd, data)
            if self.active is not None:
                self.active.written(fd)
            return n

        def removal_of(name: str) -> Callable[..., None]:
            def remove(path: Any, *, dir_fd: int | None = None) -> None:
                st = _stat_or_none(path, dir_fd)
                real[name](path, dir_fd=dir_fd)
                if self.active is not None:
                    self.active.freed(st)
            return remove

        def move_of(name: str) -> Callable[..., None]:
            def move(src: Any, dst: Any, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None) -> None:
                before = _stat_or_none(dst, dst_dir_fd)
                moving = _stat_or_none(src, src_dir_fd)
                real[name](src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
                if self.active is not None and before is not None and (
                        moving is None or (before.st_ino, before.st_dev) != (moving.st_ino, moving.st_dev)):
                    self.active.freed(before)
            return move

        for name in ("fsync", "fdatasync"):
            monkeypatch.setattr(os, name, sync_of(name))
        monkeypatch.setattr(os, "write", write)
        for name in ("unlink", "remove", "rmdir"):
            monkeypatch.setattr(os, name, removal_of(name))
        for name in ("replace", "rename"):
            monkeypatch.setattr(os, name, move_of(name))
        self._patch_meta(monkeypatch)

    def _patch_meta(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """The meta store's sync points: a flush, and the writes it makes with `sync`."""
        watch = self

        def around(name: str, synced: Callable[[tuple[Any, ...], dict[str, Any]], bool]) -> None:
            real = getattr(MetaStore, name)

            def call(self: MetaStore, *args: Any, **kwargs: Any) -> Any:
                model = watch.active
                if model is None or not synced(args, kwargs):
                    return real(self, *args, **kwargs)
                model.before_meta_sync(name)
                out = real(self, *args, **kwargs)
                model.meta_sync_point(name)
                return out
            monkeypatch.setattr(MetaStore, name, call)

        around("flush", lambda a, k: True)
        around("restore_records", lambda a, k: True)
        around("forget_segment", lambda a, k: bool(k.get("sync")))
        around("put_document", lambda a, k: bool(k.get("sync")))

    @contextmanager
    def watching(self, model: DiskModel | None) -> Iterator[None]:
        """Feed `model` (None: nothing) while inside."""
        before, self.active = self.active, model
        try:
            yield
        finally:
            self.active = before


def _stat_or_none(path: Any, dir_fd: int | None) -> os.stat_result | None:
    try:
        return os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    except (OSError, TypeError, ValueError):
        return None
