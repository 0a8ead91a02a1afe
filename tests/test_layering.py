"""Dependencies point one way (docs/ARCHITECTURE.md): checked on the source, imports inside functions included."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: package (or the core: timewheel/*.py) -> top-level names it must never import
FORBIDDEN = {
    "storage": ("timewheel", "forwarder", "spark", "coordination"),
    "timewheel-core": ("forwarder", "spark", "timewheel.app", "coordination", "kazoo"),
    "spark": ("forwarder.rocketmq.producer", "timewheel.app"),
    "forwarder": ("spark", "timewheel.app", "coordination"),
    "coordination": ("forwarder", "spark", "timewheel.app"),
}


def _files(room: str) -> list[Path]:
    if room == "timewheel-core":
        # __main__ is `python -m timewheel`: the command line's entry, not the core
        return sorted(p for p in (ROOT / "timewheel").glob("*.py") if p.name != "__main__.py")
    return sorted((ROOT / room).rglob("*.py"))


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return out


@pytest.mark.parametrize("room", sorted(FORBIDDEN))
def test_no_import_points_the_wrong_way(room: str) -> None:
    bad = [f"{p.relative_to(ROOT)}: {name}" for p in _files(room) for name in _imports(p)
           if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[room])]
    assert bad == []


def test_exactly_one_module_encodes_remoting_frames() -> None:
    encoders = [p.relative_to(ROOT).as_posix() for pkg in ("forwarder", "timewheel", "spark")
                for p in (ROOT / pkg).rglob("*.py") if "def encode_request" in p.read_text()
                or "serializeTypeCurrentRPC" in p.read_text()]
    assert encoders == ["forwarder/rocketmq/protocol.py"]
