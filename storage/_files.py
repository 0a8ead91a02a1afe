"""Small file helpers shared by the writer, recovery and check."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import time
from pathlib import Path
from typing import Callable, Iterable

log = logging.getLogger("timewheel.storage")

#: what `flock` raises on a filesystem that has no locks
_NO_LOCKS = frozenset({errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL})
#: what was said to be unsafe for want of locks (each once a process)
_no_locks_said: set[str] = set()
#: what `temporary` adds to a name
TEMPORARY_SUFFIX = ".tmp"


def write_all(fd: int, data: bytes | memoryview) -> None:
    """os.write until every byte is written."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def fsync_path(path: Path) -> None:
    """fsync a file by path, if it exists."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def close_all(closers: Iterable[Callable[[], object]], *, raising: bool = True) -> None:
    """Call every one of `closers` whatever the others raise (one that fails must not leave the rest
    open), then raise the first error (none without `raising`: the caller's own failure is the one to
    raise); the others are logged."""
    first: BaseException | None = None
    for close in closers:
        try:
            close()
        except BaseException as e:
            if raising and first is None:
                first = e
                continue
            log.error("closing failed (another error is the one raised)", exc_info=True)
    if first is not None:
        raise first


def size_of(path: Path) -> int:
    """File size, 0 when missing."""
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return 0


def lock_exclusive(fd: int, path: Path, unsafe: str, timeout_s: float | None = None) -> None:
    """`flock` a descriptor exclusively (until `unlock` or its close); on a filesystem without
    locks, go on and say once what is then not safe (`unsafe`). With `timeout_s`, TimeoutError
    once another process has held it that long (paused halfway through its write?)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    nap = 0.0005
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if deadline is None else fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            assert deadline is not None
            if time.monotonic() >= deadline:
                raise TimeoutError(errno.ETIMEDOUT, f"another process has held its lock for {timeout_s:g} s "
                                   "(one stopped halfway through a write?)")
            time.sleep(nap)
            nap = min(nap * 2, 0.05)
        except OSError as e:
            if e.errno not in _NO_LOCKS:
                raise
            # the writers go on as they did before the lock: the engine alone is safe, `unsafe` is not
            if unsafe not in _no_locks_said:
                _no_locks_said.add(unsafe)
                log.warning("%s cannot be locked (%s): %s is not safe on this filesystem", path, e, unsafe)
            return


def unlock(fd: int) -> None:
    """Let a `lock_exclusive` go (a filesystem without locks has none to let go)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError as e:
        if e.errno not in _NO_LOCKS:
            raise


def temporary(path: Path) -> Path:
    """The name a file is made under beside `path` before it is renamed to it (`remake`)."""
    return path.with_name(path.name + TEMPORARY_SUFFIX)


def remake(fd: int, path: Path) -> int:
    """Make a file deleted while `fd` held it open (readable) again at `path`, with every byte it has:
    copied to a temporary name beside it, fsynced (its bytes before its name), then renamed to `path`.
    Returns a descriptor of the new file open to read and append; the caller closes `fd` and has the
    directory fsynced. A crash before the rename leaves the copy (`storage._leftovers` settles it)."""
    tmp = temporary(path)
    new = os.open(tmp, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        at, size = 0, os.fstat(fd).st_size
        while at < size:
            chunk = os.pread(fd, min(size - at, 1 << 20), at)
            if not chunk:
                break
            write_all(new, chunk)
            at += len(chunk)
        os.fsync(new)
        os.replace(tmp, path)
    except BaseException:
        os.close(new)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return new
