"""Small file helpers shared by the writer, recovery and check."""
from __future__ import annotations

import os
from pathlib import Path


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


def size_of(path: Path) -> int:
    """File size, 0 when missing."""
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return 0
