"""docs/ARCHITECTURE.md matches the code: every path it names exists, every name it quotes is defined."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ARCHITECTURE.md"
PACKAGES = ("storage", "timewheel", "forwarder", "spark", "coordination")
_ELSEWHERE = {"numpy.fromfile", "kazoo"}  # names of libraries the page mentions


def _source() -> str:
    return "\n".join(p.read_text() for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def test_every_path_in_the_architecture_page_exists() -> None:
    paths = set(re.findall(r"`([\w/]+\.(?:py|md|json))`", DOC.read_text()))
    assert paths
    missing = [p for p in sorted(paths) if not (ROOT / p).exists()]
    assert missing == []


def test_every_name_in_the_architecture_page_is_defined() -> None:
    source = _source()
    names = {n for n in re.findall(r"`([A-Za-z_][\w.]*)(?:\([^`]*\))?`", DOC.read_text())
             if not re.search(r"\.(py|md|json)$", n)}
    assert len(names) > 20
    undefined = []
    for name in sorted(names):
        last = name.split(".")[-1]
        defined = re.search(rf"^\s*(class|def)\s+{re.escape(last)}\b|^\s*(self\.)?{re.escape(last)}\s*[:=]|"
                            rf"[\"']{re.escape(last)}[\"']", source, re.M)
        module = (ROOT / (name.replace(".", "/") + ".py")).exists() or (ROOT / name.replace(".", "/")).is_dir()
        if not (defined or module or name in _ELSEWHERE):
            undefined.append(name)
    assert undefined == []
