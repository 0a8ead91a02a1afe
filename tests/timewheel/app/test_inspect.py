"""`timewheel inspect` as a user runs it: damage it finds is bad news (exit 1, as `audit`'s findings
are), named on stdout with the counters of everything else, and a file of the data directory it
cannot read is such damage, not the end of the command."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from storage import CORRUPT, DELIVERED, Record, ScheduleStore, dispatch_entries

NOW = 1_795_460_400_000  # 2026-11-23 19:00 UTC
HOUR = 3_600_000


def _stored(tmp_path: Path) -> tuple[Path, list[Path]]:
    """Two segments of three records, one of each delivered; the data directory and both segment directories."""
    d = tmp_path / "data"
    with ScheduleStore(d) as store:
        segs = []
        for h in range(2):
            store.append([Record(f"m{h}-{i}", "ORDERS", b"body", NOW + h * HOUR + 5_000 + i) for i in range(3)], NOW)
            seg = store.layout.segment_start(NOW + h * HOUR)
            ix = store.segment_index(seg)
            store.record_dispatch(seg, dispatch_entries(ix.part[:1], ix.offset[:1], ix.due_ms[:1], NOW, DELIVERED),
                                  NOW)
            segs.append(store.layout.segment_dir(seg))
    return d, segs


def _inspect(d: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "timewheel", "inspect", "--data-dir", str(d), *flags],
                          capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})


def _flip_last_record(seg: Path) -> None:
    log = seg / "00000.log"
    data = bytearray(log.read_bytes())
    data[-2] ^= 0xFF
    log.write_bytes(bytes(data))


@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
def test_inspect_verify_exits_1_when_it_finds_a_corrupt_record(tmp_path: Path, as_json: bool) -> None:
    d, segs = _stored(tmp_path)
    assert _inspect(d, "--verify").returncode == 0  # nothing wrong yet
    _flip_last_record(segs[1])
    res = _inspect(d, "--verify", *(["--json"] if as_json else []))
    assert res.returncode == 1, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr, res.stderr
    if as_json:
        assert [f["kind"] for f in json.loads(res.stdout)["findings"]] == ["corrupt_record"]
    else:
        assert "corrupt_record" in res.stdout and str(segs[1] / "00000.log") in res.stdout, res.stdout


# inspect alone reads no record (the index says what a part holds), so a part's record file only with --verify
@pytest.mark.parametrize(("name", "flags"), [("00000.idx", ()), ("dispatch.log", ()), ("00000.log", ("--verify",)),
                                             ("00000.idx", ("--verify",)), ("dispatch.log", ("--verify",))],
                         ids=lambda v: " ".join(v) if isinstance(v, tuple) else v)
def test_inspect_names_a_file_it_cannot_read_and_counts_the_rest(tmp_path: Path, name: str,
                                                                 flags: tuple[str, ...]) -> None:
    d, segs = _stored(tmp_path)
    (segs[0] / name).unlink()
    (segs[0] / name).mkdir()
    res = _inspect(d, *flags, "--json")
    assert res.returncode == 1, (res.returncode, res.stdout, res.stderr)
    report = json.loads(res.stdout)
    unreadable = [f for f in report["findings"] if f["kind"] == "unreadable"]
    assert [f["path"] for f in unreadable] == [str(segs[0] / name)], report["findings"]
    assert "Is a directory" in unreadable[0]["detail"]
    second = report["segments"][1]  # the other segment, counted as ever
    assert (second["records"], second["dispatched"], second["pending"]) == (3, 1, 2), report
    table = _inspect(d, *flags)
    assert table.returncode == 1 and f"unreadable {segs[0] / name}" in table.stdout.replace("\n", ""), table.stdout


def test_inspect_fix_repairs_what_verify_found_and_verify_then_finds_nothing(tmp_path: Path) -> None:
    # check(fix=True) was reachable from Python only: an operator told "fix=True mends it" had no command
    d, segs = _stored(tmp_path)
    org = segs[0] / "00000.org"
    os.truncate(org, org.stat().st_size // 3 + 5)  # rows lost, the last one torn
    found = _inspect(d, "--verify")
    assert found.returncode == 1 and "corrupt_origin" in found.stdout, (found.stdout, found.stderr)
    assert os.path.getsize(org) % 16 != 0  # --verify alone changes nothing
    fixed = _inspect(d, "--fix", "--json")
    assert fixed.returncode == 1, (fixed.stdout, fixed.stderr)  # damage was found: bad news, even repaired
    doc = json.loads(fixed.stdout)
    assert [f["kind"] for f in doc["findings"]] == ["corrupt_origin"] and doc["fixed"] == 1
    assert "mended" in doc["findings"][0]["detail"]
    again = _inspect(d, "--verify")
    assert again.returncode == 0, (again.stdout, again.stderr)


def test_inspect_fix_marks_a_corrupt_record_so_it_is_never_served(tmp_path: Path) -> None:
    d, segs = _stored(tmp_path)
    _flip_last_record(segs[1])
    res = _inspect(d, "--fix")
    assert res.returncode == 1 and "corrupt_record" in res.stdout and "1 repair(s) made" in res.stdout, res.stdout
    with ScheduleStore(d) as store:
        log = store.dispatch_log(store.layout.segment_start(NOW + HOUR))
        assert CORRUPT in log.entries["outcome"].tolist()  # stamped now, not at the epoch
        assert int(log.entries["dispatch_ms"].max()) > NOW
