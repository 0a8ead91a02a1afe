"""Small modules with one job: no product module over 450 lines (the hash wheel excepted)."""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("timewheel", "storage", "forwarder", "coordination", "spark")
MAX_LINES = 450
#: the hash wheel keeps its slot arithmetic in one place, on purpose
EXCEPTED = {"timewheel/wheel.py"}


def test_no_product_module_is_over_the_limit() -> None:
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines())
             for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    assert sizes  # the packages were found
    over = {path: n for path, n in sorted(sizes.items()) if n > MAX_LINES and path not in EXCEPTED}
    assert over == {}
