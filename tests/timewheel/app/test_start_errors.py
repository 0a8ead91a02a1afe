"""An OSError at the engine's start is called the data directory's only when it names a path in it:
a full disk or a process out of descriptors once read "cannot open the data directory", sending the
operator to check a directory that was fine."""
from __future__ import annotations

import errno
from pathlib import Path

import pytest

from timewheel.app.datadir import os_error_at_start


@pytest.mark.parametrize(("error", "says"), [
    (PermissionError(errno.EACCES, "Permission denied", "{d}/meta/LOCK"), "cannot open the data directory {d}"),
    (OSError(errno.ENOSPC, "No space left on device", "{d}/ingest/00000001.log"), "cannot open the data directory"),
    (OSError(errno.EMFILE, "Too many open files"), "the engine could not start: [Errno 24] Too many open files"),
    (OSError(errno.ENOENT, "No such file or directory", "/etc/elsewhere"), "the engine could not start"),
    (OSError(errno.ENOENT, "No such file or directory", "{d}-other/meta"), "the engine could not start"),
])
def test_an_os_error_at_start_names_the_data_directory_only_when_it_is_its(tmp_path: Path, error: OSError,
                                                                           says: str) -> None:
    d = str(tmp_path / "data")
    if error.filename is not None:
        error.filename = error.filename.format(d=d)
    text = os_error_at_start(error, d)
    assert text.startswith(says.format(d=d)), text
    assert (error.strerror or "") in text
