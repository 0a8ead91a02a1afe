"""A data directory whose meta store a failing disk damaged (bytes flipped in its table files): `find`
and `serve` say so in one line naming the file (exit 2, as for any file they cannot read), and
`inspect --verify` reports it among its findings (exit 1). `find --id` died with rocksdict's bare
`Exception` (a traceback, exit 1: "no message matches"), `find --key` answered that no message was
stored, a damaged table read at open was called "in use by another engine", `serve` died with a
traceback, and `inspect --verify` found nothing wrong."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
from typer.testing import CliRunner

from storage import MetaStoreCorruptError
from tests.storage._meta_damage import NOW, damage_data_blocks, damage_one_document, damage_tables_whole, stored
from tests.timewheel.conftest import T0, RecordingSink
from timewheel import Engine, EngineConfig, ManualClock, Message
from timewheel.app.cli import app
from timewheel.find import MessageFinder

ROOT = Path(__file__).resolve().parents[3]
_DAMAGE = [damage_data_blocks, damage_tables_whole]


def _listing(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): (p.stat().st_size if p.is_file() else -1) for p in root.rglob("*")}


def _one_line_naming(output: str, d: Path, damaged: list[Path]) -> str:
    lines = output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("timewheel: "), output
    line = lines[0]
    assert "corrupt" in line and str(d / "meta") in line, line
    assert any(str(t) in line for t in damaged), (line, damaged)
    assert "in use by another engine" not in line, line
    return line


@pytest.mark.parametrize("query", [["--id", "m0"], ["--key", "k"], ["--id", "m0", "--json"], ["--key", "k", "--json"]],
                         ids=" ".join)
@pytest.mark.parametrize("damage", _DAMAGE, ids=lambda f: f.__name__)
def test_find_over_a_corrupt_meta_store_says_so_in_one_line_and_exits_2(
        tmp_path: Path, query: list[str], damage: Callable[[Path], list[Path]]) -> None:
    d = stored(tmp_path)
    damaged = damage(d)
    before = _listing(d)
    res = CliRunner().invoke(app, ["find", "--data-dir", str(d), *query])
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert res.exit_code == 2, res.output
    _one_line_naming(res.output, d, damaged)
    assert _listing(d) == before, "find wrote into the data directory"


@pytest.mark.parametrize("damage", _DAMAGE, ids=lambda f: f.__name__)
def test_find_raises_the_typed_error_and_says_in_the_words_serve_says(
        tmp_path: Path, damage: Callable[[Path], list[Path]]) -> None:
    """Damage met as the meta store is opened (whole tables) was wrapped in a plain StorageError, "cannot
    read the meta store of DIR: ...": not a `MetaStoreCorruptError` to whoever calls the look-up, and a
    line of its own on the command line, where `serve` says the error's own words."""
    d = stored(tmp_path)
    damaged = damage(d)
    with pytest.raises(MetaStoreCorruptError) as raised:
        with MessageFinder.beside_engine(d) as finder:
            finder.by_key("k", NOW)
    assert raised.value.file in [str(t) for t in damaged], raised.value
    res = CliRunner().invoke(app, ["find", "--data-dir", str(d), "--key", "k"])
    assert res.exit_code == 2, res.output
    line = _one_line_naming(res.output, d, damaged)
    assert line == f"timewheel: {raised.value}"
    errors = [e for e in _serve(d).stderr.splitlines() if e.startswith("timewheel: ")]
    assert errors == [line]


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
@pytest.mark.parametrize("damage", _DAMAGE, ids=lambda f: f.__name__)
def test_inspect_verify_reports_a_corrupt_meta_store_and_exits_1(
        tmp_path: Path, as_json: bool, damage: Callable[[Path], list[Path]]) -> None:
    d = stored(tmp_path)
    damaged = damage(d)
    before = _listing(d)
    res = CliRunner().invoke(app, ["inspect", "--data-dir", str(d), "--verify", *(["--json"] if as_json else [])])
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert res.exit_code == 1, res.output
    if as_json:
        report = json.loads(res.output)
        (finding,) = report["findings"]
        assert finding["kind"] == "corrupt_meta_store" and finding["path"] in [str(t) for t in damaged], finding
        assert report["totals"]["records"] == 3  # the segments counted as ever
    else:
        text = res.output.replace("\n", "")
        assert "corrupt_meta_store" in text and any(str(t) in text for t in damaged), res.output
    assert _listing(d) == before, "inspect wrote into the data directory"


def _serve(d: Path) -> subprocess.CompletedProcess[str]:
    # no broker: the start is refused before anything connects (the meta store is opened first)
    return subprocess.run([sys.executable, "-m", "timewheel", "serve", "--data-dir", str(d), "--namesrv", "127.0.0.1:9",
                           "--admin", "127.0.0.1:0"], capture_output=True, text=True, timeout=120,
                          env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("damage", _DAMAGE, ids=lambda f: f.__name__)
def test_serve_over_a_corrupt_meta_store_refuses_to_start_in_one_line(
        tmp_path: Path, damage: Callable[[Path], list[Path]]) -> None:
    d = stored(tmp_path)
    damaged = damage(d)
    out = _serve(d)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("timewheel: ")]
    assert len(errors) == 1, out.stderr[-3000:]
    _one_line_naming(errors[0], d, damaged)


def test_serve_refuses_in_one_line_when_the_damage_is_met_after_the_engine_started(tmp_path: Path) -> None:
    """The traffic rules are read from the meta store once the engine has started: a table holding only
    them is read there first, and the start that fails there is refused the same way."""
    d = stored(tmp_path)
    rules_table = damage_one_document(d, "shaping_rules", {"rules": {}, "source": "admin", "file_digest": "",
                                                           "applied_ms": 0})
    out = _serve(d)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("timewheel: ")]
    assert len(errors) == 1, out.stderr[-3000:]
    _one_line_naming(errors[0], d, [rules_table])


def test_an_engine_started_with_its_meta_store_moved_aside_sends_nothing_again_but_forgets_the_ids(
        tmp_path: Path) -> None:
    """What docs/OPERATIONS.md ("A corrupt meta store") tells an engine without [ha] to do, and what it
    costs: the outcomes are in the dispatch logs, so what was delivered or cancelled is not sent again
    and what is pending is sent once; the id index is gone, so a message read again is delivered again
    and a cancel of one stored before finds nothing."""
    clock = ManualClock(T0)
    sink = RecordingSink(clock)
    cfg = EngineConfig(tmp_path / "data", tick_ms=100, segment_minutes=1, preload_seconds=10)

    def run_to(engine: Engine, until_ms: int) -> None:
        while clock.now_ms() < until_ms:
            clock.set(min(until_ms, clock.now_ms() + 100))
            for _ in range(3):  # a catch-up of a past segment takes a pass of its own
                engine.step()

    engine = Engine(cfg, sink, clock, seed=0).start(background=False)
    engine.schedule([Message("T", b"x", T0 + i * 20_000, msg_id=f"m{i}", keys=(f"k{i}",)) for i in range(12)])
    run_to(engine, T0 + 125_000)  # m0..m6 delivered, over three one-minute segments
    assert engine.cancel("m9") == 1
    engine.stop()
    assert sorted(m for m, _ in sink.sent) == [f"m{i}" for i in range(7)]
    shutil.move(tmp_path / "data" / "meta", tmp_path / "meta-aside")
    sink.sent.clear()
    engine = Engine(cfg, sink, clock, seed=0).start(background=False)
    try:
        run_to(engine, T0 + 130_000)
        assert sink.sent == []  # nothing delivered before is sent again
        engine.schedule([Message("T", b"x", T0 + 20_000, msg_id="m1", keys=("k1",))])  # m1 read again
        assert engine.cancel("m10") == 0  # stored before the move: not found
        run_to(engine, T0 + 300_000)
    finally:
        engine.stop()
    assert sorted(m for m, _ in sink.sent) == ["m1", "m10", "m11", "m7", "m8"]  # m9 stays cancelled
