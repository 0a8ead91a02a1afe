"""`bench.peers.run`'s brokers: one of its own for each system that needs RocketMQ, or one for the run."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.peers import runner
from bench.peers.runner import RunConfig


class _FakeBroker:
    started: list[_FakeBroker] = []

    def __init__(self, root: Path) -> None:
        self.root, self.mq, self.producer, self.stopped = root, f"mq {root.name}", f"producer {root.name}", 0
        root.mkdir(parents=True)
        (root / "store").write_bytes(b"x")
        logs = root / "broker-a" / "logs" / "rocketmqlogs"  # as a broker's node folder holds them
        logs.mkdir(parents=True)
        (logs / "store.log").write_text(f"[PAGECACHERT] of {root.name}\n")
        (logs / "big.bin").write_bytes(b"not a log")
        _FakeBroker.started.append(self)

    def stop(self) -> None:
        self.stopped += 1


_Seen = tuple[list[_FakeBroker], list[tuple[str, Any]]]


@pytest.fixture
def brokers(monkeypatch: pytest.MonkeyPatch) -> _Seen:
    _FakeBroker.started = []
    seen: list[tuple[str, Any]] = []
    monkeypatch.setattr(runner, "_Broker", _FakeBroker)
    def row(name: str, cfg: RunConfig, mq: object, log: object) -> dict[str, object]:
        # a broker stopped before this system must have left no store behind (the run's own end would
        # delete them all, too late for the systems after it)
        assert not any(b.root.exists() for b in _FakeBroker.started if b.stopped), f"a store is left under {name}"
        seen.append((name, mq))
        return {}

    monkeypatch.setattr(runner, "_run_broker_row", row)
    monkeypatch.setattr(runner, "_run_system", lambda name, cfg, work, mq, producer, log: row(name, cfg, mq, log))
    return _FakeBroker.started, seen


def test_each_system_that_needs_rocketmq_gets_a_fresh_broker_stopped_and_deleted_after_it(brokers: _Seen) -> None:
    started, seen = brokers
    doc = runner.run(RunConfig(systems=("plain-hop", "intake-ceiling", "heapq", "timewheel")), "test", log=lambda _: None)
    assert [b.root.name for b in started] == ["mq-plain-hop", "mq-intake-ceiling", "mq-timewheel"]
    assert seen == [("plain-hop", "mq mq-plain-hop"), ("intake-ceiling", "mq mq-intake-ceiling"),
                    ("heapq", None), ("timewheel", "mq mq-timewheel")], "heapq runs with no broker"
    assert all(b.stopped == 1 and not b.root.exists() for b in started), "stopped once, its store deleted"
    assert doc["rocketmq"] == {"broker_per_system": True}


def test_one_broker_for_the_whole_run_when_asked(brokers: _Seen) -> None:
    started, seen = brokers
    runner.run(RunConfig(systems=("plain-hop", "heapq", "timewheel"), broker_per_system=False), "test",
               log=lambda _: None)
    assert len(started) == 1 and started[0].stopped == 1
    assert [mq for _, mq in seen] == ["mq mq", "mq mq", "mq mq"], "the shared broker stays up through heapq"


def test_each_brokers_logs_are_kept_before_its_store_goes_when_asked(brokers: _Seen, tmp_path: Path) -> None:
    runner.run(RunConfig(systems=("plain-hop", "timewheel"), broker_logs=str(tmp_path / "logs")), "test",
               log=lambda _: None)
    kept = sorted(p.relative_to(tmp_path / "logs").as_posix() for p in (tmp_path / "logs").rglob("*") if p.is_file())
    assert kept == ["plain-hop/broker-a/store.log", "timewheel/broker-a/store.log"], "the logs only, per system"
    assert (tmp_path / "logs/timewheel/broker-a/store.log").read_text() == "[PAGECACHERT] of mq-timewheel\n"
    shared = tmp_path / "shared-logs"
    runner.run(RunConfig(systems=("plain-hop",), broker_per_system=False, broker_logs=str(shared)), "test",
               log=lambda _: None)
    assert (shared / "shared/broker-a/store.log").exists(), "one broker for the run: its logs when it stops"


def test_a_phase_given_no_messages_or_no_time_is_skipped_not_run() -> None:
    from bench.peers.runner import _given_zero
    from bench.peers.systems import System

    class _Sys:
        horizon_count: int | None = None

    s: System = _Sys()  # type: ignore[assignment]
    cfg = RunConfig(steady_high_seconds=0, burst=0, horizon_messages=0)
    assert [p for p in ("steady", "steady_high", "burst", "horizon", "batch_ingest") if _given_zero(p, s, cfg)] \
        == ["steady_high", "burst", "horizon"]
    s.horizon_count = 100_000  # the broker's timer and levels take theirs from --horizon-broker-messages
    assert not _given_zero("horizon", s, cfg)
    assert not any(_given_zero(p, s, RunConfig()) for p in ("steady", "steady_high", "burst", "horizon", "batch_ingest"))


def test_timewheel_runs_the_engine_of_the_tree_it_is_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    import bench.peers.systems as systems

    tree = tmp_path / "old"
    (tree / "timewheel").mkdir(parents=True)
    (tree / "timewheel" / "__main__.py").write_text("")
    started: list[dict[str, object]] = []

    class _Started:
        pid = 1

        def __init__(self, cmd: list[str], **kw: object) -> None:
            started.append({"cmd": cmd, **kw})

        def poll(self) -> None:
            return None

    mq = type("MQ", (), {"namesrv_addr": "127.0.0.1:9876"})()
    system = systems.Timewheel(lambda *a: None, tmp_path / "work", mq, None, engine_tree=tree)  # type: ignore[arg-type]
    monkeypatch.setattr(subprocess, "Popen", _Started)  # the engine's start only (its commit was asked of git)
    (tmp_path / "work").mkdir()
    system._start_process(wait=False)
    assert started[0]["cwd"] == tree
    assert "horizon" not in system.phases and "batch_ingest" in system.phases, "no prefill in this checkout's layout"
    assert system.notes[-1].startswith("the engine of old, another checkout"), "not a git checkout: its name"
    assert "horizon" in systems.Timewheel(lambda *a: None, tmp_path / "work", mq, None).phases  # type: ignore[arg-type]
    assert started[0]["cmd"][1:4] == ["-m", "timewheel", "serve"]  # type: ignore[index]
    with pytest.raises(ValueError, match="not a timewheel checkout"):
        systems.Timewheel(lambda *a: None, tmp_path / "work", mq, None, engine_tree=tmp_path)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="this checkout's engine only"):
        systems.Timewheel(lambda *a: None, tmp_path / "work", mq, None,  # type: ignore[arg-type]
                          stages=tmp_path / "s.jsonl", engine_tree=tree)


def test_another_checkouts_engine_is_named_by_its_commit() -> None:
    import subprocess

    from bench.peers.systems import _revision_of

    here = Path(__file__).resolve().parents[2]
    head = subprocess.run(["git", "-C", str(here), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    assert _revision_of(here) == head.stdout.strip()
