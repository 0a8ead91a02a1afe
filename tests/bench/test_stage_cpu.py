"""`bench.stage_cpu`: wrapped stages count their calls and the calling thread's CPU, and come off again."""
from __future__ import annotations

import json
import sys
import time
import types
from pathlib import Path

import pytest

from bench import stage_cpu
from bench.stage_cpu import StageClock


def _module(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A module with a class method and a function, and a second module that imported the function by name."""
    mod = types.ModuleType("_stage_cpu_probe")

    class Worker:
        def spin(self, seconds: float) -> str:
            end = time.thread_time() + seconds
            while time.thread_time() < end:
                pass
            return "spun"

    def helper(x: int) -> int:
        return x + 1

    mod.Worker = Worker  # type: ignore[attr-defined]
    mod.helper = helper  # type: ignore[attr-defined]
    user = types.ModuleType("_stage_cpu_probe_user")
    user.helper = helper  # type: ignore[attr-defined]  # as `from _stage_cpu_probe import helper` binds it
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setitem(sys.modules, user.__name__, user)
    return mod


def test_stages_count_calls_and_cpu_and_are_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = _module(monkeypatch)
    user = sys.modules["_stage_cpu_probe_user"]
    spin, helper = mod.Worker.spin, mod.helper
    clock = StageClock([(mod.__name__, "Worker", "spin", "spin"), (mod.__name__, "", "helper", "helper")])
    with clock:
        assert mod.Worker().spin(0.02) == "spun"
        assert user.helper(1) == 2  # the name bound elsewhere is timed too
        assert mod.helper(2) == 3
    assert clock.calls["spin"] == 1 and clock.calls["helper"] == 2
    assert 0.015 <= clock.cpu["spin"] < 1.0
    assert mod.Worker.spin is spin and mod.helper is helper and user.helper is helper
    mod.Worker().spin(0.001)
    assert clock.calls["spin"] == 1  # nothing is counted once the clock is left
    assert "spin" in clock.table(1, "call")


def test_a_stage_that_raises_is_still_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = _module(monkeypatch)

    def boom(self: object) -> None:
        raise ValueError("no")

    mod.Worker.boom = boom
    with StageClock([(mod.__name__, "Worker", "boom", "boom")]) as clock:
        with pytest.raises(ValueError):
            mod.Worker().boom()
    assert clock.calls["boom"] == 1


def test_timeline_and_table_read_the_snapshots(tmp_path: Path) -> None:
    ticks, commits, sends = stage_cpu._TICKS, stage_cpu._COMMITS, stage_cpu._SENDS
    snaps = [
        {"t": 100.0, "cpu": {"dispatch pass": 0.0, ticks: 0.0}, "calls": {sends: 0, ticks: 0, commits: 0,
                                                                           "dispatch pass": 0},
         "threads": {"timewheel-dispatch": 1.0}, "process": 5.0, "minor_faults": 10},
        {"t": 102.0, "cpu": {"dispatch pass": 0.2, ticks: 0.1}, "calls": {sends: 100, ticks: 100, commits: 100,
                                                                           "dispatch pass": 100},
         "threads": {"timewheel-dispatch": 1.25}, "process": 5.5, "minor_faults": 30},
    ]
    f = tmp_path / "stages.jsonl"
    f.write_text("".join(json.dumps(s) + "\n" for s in snaps))
    timeline = stage_cpu.timeline(f)
    assert timeline.splitlines()[1].split() == ["2", "100", "100", "100", "100", "200", "0"]
    table = stage_cpu.table(f, 0, 2, 1000)  # 2,000 messages in the interval
    row = next(line for line in table.splitlines() if line.startswith("dispatch pass"))
    assert row.split()[2:4] == ["100.00", "2000.0"]  # µs a message, µs a call
    assert "250000" not in table
    assert any(line.startswith("timewheel-dispatch") and line.split()[-1] == "125.00" for line in table.splitlines())
    assert any(line.startswith("the process") and line.split()[-1] == "250.00" for line in table.splitlines())


def test_a_call_over_the_slow_limit_is_kept_with_its_wall_time_and_cpu(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path) -> None:
    mod = _module(monkeypatch)

    def wait(self: object, seconds: float) -> None:
        time.sleep(seconds)

    mod.Worker.wait = wait
    with StageClock([(mod.__name__, "Worker", "wait", "wait"), (mod.__name__, "Worker", "spin", "spin")],
                    slow_ms=20) as clock:
        mod.Worker().wait(0.001)
        mod.Worker().wait(0.04)
        mod.Worker().spin(0.001)
    assert len(clock.slow) == 1, "only the call over 20 ms"
    _, thread, label, wall_ms, cpu_ms, queued_ms = clock.slow[0]
    assert label == "wait" and thread == "MainThread"
    assert wall_ms >= 40 and cpu_ms < wall_ms / 2, "it slept: wall time, little CPU"
    assert 0 <= queued_ms < wall_ms / 2, "asleep, not waiting for a CPU"
    f = tmp_path / "stages.jsonl"
    f.write_text(json.dumps({"t": 100.0, "cpu": {}, "calls": {}, "threads": {}, "process": 0, "minor_faults": 0,
                             "slow": [[101.5, thread, "  wait", 50.0, 1.0, 4.0],
                                      [102.0, thread, "  wait", 30.0, 2.0]]}) + "\n")  # as before run queues
    listed = [line.split() for line in stage_cpu.slow_calls(f).splitlines()]
    assert len(listed) == 4 and listed[1][:3] == ["1.50", "MainThread", "wait"]
    assert listed[1][3:] == ["50.0", "1.00", "4.00", "45.0"], "asleep: wall less CPU less the run queue"
    assert listed[2][3:] == ["30.0", "2.00", "-", "28.0"]
    assert listed[3] == ["all", "2", "calls", "80.0", "3.00", "4.00", "73.0"]


def test_a_thread_that_waits_for_a_cpu_shows_it_in_its_run_queue_time() -> None:
    import hashlib
    import os
    import threading

    if not os.path.exists("/proc/thread-self/schedstat"):
        pytest.skip("this kernel keeps no schedstat")
    # More threads than CPUs, each hashing (hashlib lets go of the GIL) for 0.3 s of its own CPU: each
    # waits in the run queue while the others run, about (threads / CPUs - 1) times that in all.
    data = b"x" * (1 << 20)
    waited: dict[int, int] = {}

    def work(i: int) -> None:
        before = stage_cpu.run_queue_ns()
        end = time.thread_time() + 0.3
        while time.thread_time() < end:
            hashlib.sha256(data).digest()
        waited[i] = stage_cpu.run_queue_ns() - before

    cpus = len(os.sched_getaffinity(0))
    n = 2 * cpus + 2
    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected_s = n * 0.3 * (n / cpus - 1)
    assert sum(waited.values()) / 1e9 > expected_s / 4, (sum(waited.values()) / 1e9, expected_s)


def test_without_a_slow_limit_nothing_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = _module(monkeypatch)
    with StageClock([(mod.__name__, "Worker", "spin", "spin")]) as clock:
        mod.Worker().spin(0.03)
    assert clock.slow == [] and clock.calls["spin"] == 1


def test_a_stage_that_waits_by_design_is_never_listed_slow(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = _module(monkeypatch)

    def wait(self: object, seconds: float) -> None:
        time.sleep(seconds)

    mod.Worker.wait = wait
    waits = next(iter(stage_cpu.WAITS))  # the dispatch threads' wait for work ("queue: await turn")
    with StageClock([(mod.__name__, "Worker", "wait", waits)], slow_ms=5) as clock:
        mod.Worker().wait(0.02)
    assert clock.calls[waits] == 1 and clock.slow == []


def test_every_stage_the_serve_run_wraps_names_a_real_method() -> None:
    import importlib

    for module, cls, method, label in stage_cpu.SERVE_STAGES:
        owner = getattr(importlib.import_module(module), cls) if cls else importlib.import_module(module)
        assert callable(getattr(owner, method, None)), f"{label.strip()}: {module}.{cls}.{method} is gone"
