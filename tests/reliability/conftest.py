"""Fixtures of the reliability harness: a small tmpfs for full-disk faults."""
from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 3 MiB tmpfs mounted for one test (needs root, as CI and the dev machines run)."""
    mnt = tmp_path / f"tmpfs-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs for the full-disk test (root needed): {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
