"""No file the project keeps names a path of the machine it was made on (scratch directories, a home)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: an absolute path into a scratch or home directory: what a run on another machine could not use
_MACHINE_PATH = re.compile(rb"(?<![\w.])/(?:tmp|root|home|work)/[\w.-]+")


def test_no_kept_file_names_a_machine_path() -> None:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    found = []
    for name in filter(None, files):
        path = ROOT / name.decode()
        if not path.is_file() or path.stat().st_size > 5_000_000:
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:  # binary
            continue
        for m in _MACHINE_PATH.finditer(data):
            line = data.count(b"\n", 0, m.start()) + 1
            found.append(f"{name.decode()}:{line}: {m.group().decode(errors='replace')}")
    assert not found, "machine paths (write DIR or a relative path instead):\n" + "\n".join(found[:20])
