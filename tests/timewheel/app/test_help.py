"""`--help` shows every command's text as written: bracketed words ([ha], [rocketmq]) included."""
from __future__ import annotations

import re
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from timewheel.app.cli import app

_BRACKETED = re.compile(r"\[[a-z_.]+\]")


def _commands() -> list[tuple[list[str], Any]]:
    root: Any = typer.main.get_command(app)
    return [([], root)] + [([name], cmd) for name, cmd in sorted(root.commands.items())]


def _texts(cmd: Any) -> list[str]:
    return [cmd.help or "", *(getattr(p, "help", None) or "" for p in cmd.params)]


@pytest.mark.parametrize("path,cmd", [pytest.param(p, c, id=" ".join(p) or "timewheel") for p, c in _commands()])
def test_help_shows_bracketed_words_as_written(path: list[str], cmd: Any) -> None:
    out = CliRunner().invoke(app, [*path, "--help"], terminal_width=100)
    assert out.exit_code == 0, out.output
    wanted = {w for text in _texts(cmd) for w in _BRACKETED.findall(text)}
    missing = sorted(w for w in wanted if w not in out.output)
    assert not missing, f"{' '.join(path) or 'timewheel'} --help lost {missing}:\n{out.output}"
    assert "()" not in out.output or "()" in " ".join(_texts(cmd)), out.output


def test_the_commands_that_mention_sections_are_checked() -> None:
    mentioned = {" ".join(p) for p, c in _commands() if any(_BRACKETED.search(t) for t in _texts(c))}
    assert {"broker", "zookeeper"} <= mentioned
