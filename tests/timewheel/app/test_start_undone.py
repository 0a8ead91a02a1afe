"""A start that fails at any step, with any error, stops what it had started, last first, and raises
that error as it was: no engine thread left to send, no descriptor, no lock on the data directory, no
admin port held, no garbage-collector callback installed. Only the errors the start knew by name once
did so; any other (a pull thread that could not start, a broken rules store) left the engine and its
dispatchers running behind the raised error."""
from __future__ import annotations

import gc
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import forwarder
from forwarder.config import RocketMQConfig
from forwarder.ingest import DelayTopicIngest
from forwarder.shaping_control import ShapingControl
from storage import ScheduleStore
from tests.polling import wait_for
from timewheel.app.service import Service
from timewheel.app.settings import AdminConfig, Settings
from timewheel.config import EngineConfig
from timewheel.engine import Engine


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _service_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith(("timewheel-", "ingest-")))


class _Refused(Exception):
    """An error no step of the start names."""


def _source_fails(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> None:
    def start(self: DelayTopicIngest, schedule: Any, cancel: Any = None, encoded: Any = None) -> None:
        raise error

    monkeypatch.setattr(DelayTopicIngest, "start", start)


def _shaping_fails(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> None:
    real = ShapingControl.start

    def start(self: ShapingControl, documents: Any = None, *, watch: bool = True) -> ShapingControl:
        real(self, documents, watch=watch)  # the watch thread runs, then the start fails
        raise error

    monkeypatch.setattr(ShapingControl, "start", start)


def _connect_fails(monkeypatch: pytest.MonkeyPatch, error: BaseException) -> None:
    def connect(*args: Any, **kwargs: Any) -> Any:
        raise error

    monkeypatch.setattr(forwarder, "connect_rocketmq", connect)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="descriptors are counted through /proc")
@pytest.mark.parametrize("fail", [_source_fails, _shaping_fails, _connect_fails],
                         ids=["source start", "shaping start", "before the engine"])
@pytest.mark.parametrize("error", [_Refused("no pull thread could start"), KeyboardInterrupt()],
                         ids=["an error", "an interrupt"])
def test_a_start_failing_with_an_unnamed_error_stops_everything_and_raises_that_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        fail: Callable[[pytest.MonkeyPatch, BaseException], None], error: BaseException) -> None:
    fail(monkeypatch, error)
    data = tmp_path / "data"
    config = tmp_path / "timewheel.toml"  # a config file: the shaping control watches it in a thread
    config.write_text("")
    threads, fds, callbacks = _service_threads(), _open_fds(), list(gc.callbacks)
    service = Service(Settings(engine=EngineConfig(data), rocketmq=RocketMQConfig(namesrv="127.0.0.1:9"),
                               admin=AdminConfig(listen="127.0.0.1:0")), config_path=config)
    with pytest.raises(type(error)) as raised:
        service.start()
    assert raised.value is error and raised.value.__cause__ is None  # as it was raised, not wrapped
    assert service.engine is None and service.admin is None and service.replica is None
    assert _service_threads() == threads  # no timer, dispatcher, housekeeper, watcher or admin thread
    assert gc.callbacks == callbacks  # the collections are no longer timed
    assert wait_for(lambda: _open_fds() <= fds, 10), _open_fds() - fds  # RocksDB lets its own go just after
    ScheduleStore(data).close()  # its meta store's lock was let go


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="descriptors are counted through /proc")
def test_a_failed_start_whose_stop_fails_too_raises_the_start_s_error_and_closes_the_rest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    error = _Refused("no pull thread could start")
    _source_fails(monkeypatch, error)
    real_stop = Engine.stop

    def stop(self: Engine) -> None:
        real_stop(self)
        raise OSError(28, "No space left on device")  # the last checkpoint, say

    monkeypatch.setattr(Engine, "stop", stop)
    threads, callbacks = _service_threads(), list(gc.callbacks)
    service = Service(Settings(engine=EngineConfig(tmp_path / "data"), rocketmq=RocketMQConfig(namesrv="127.0.0.1:9"),
                               admin=AdminConfig(listen="127.0.0.1:0")))
    with pytest.raises(_Refused) as raised:
        service.start()
    assert raised.value is error
    assert _service_threads() == threads and gc.callbacks == callbacks and service.admin is None
    assert any("No space left on device" in str(r.exc_info[1]) for r in caplog.records if r.exc_info)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="descriptors are counted through /proc")
def test_an_admin_endpoint_that_cannot_start_serving_stops_the_start_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from timewheel.app.service import StartError

    async def refused(*args: Any, **kwargs: Any) -> asyncio.AbstractServer:
        raise OSError(24, "Too many open files")

    consumed: list[str] = []
    monkeypatch.setattr(DelayTopicIngest, "start", lambda self, *a, **k: consumed.append(self.cfg.delay_topic))
    monkeypatch.setattr(asyncio, "start_server", refused)  # the admin endpoint's event loop cannot listen
    data = tmp_path / "data"
    threads, fds, callbacks = _service_threads(), _open_fds(), list(gc.callbacks)
    service = Service(Settings(engine=EngineConfig(data), rocketmq=RocketMQConfig(namesrv="127.0.0.1:9"),
                               admin=AdminConfig(listen="127.0.0.1:0")))
    with pytest.raises(StartError) as refused_start:
        service.start()
    said = str(refused_start.value)
    assert "admin.listen = '127.0.0.1:0'" in said and "Too many open files" in said, said
    assert consumed and service.engine is None and service.admin is None
    assert _service_threads() == threads and gc.callbacks == callbacks
    assert wait_for(lambda: _open_fds() <= fds, 10), _open_fds() - fds  # RocksDB lets its own go just after
    ScheduleStore(data).close()


def test_a_replica_refused_at_its_first_start_starts_again_as_the_refusal_asked_on_its_new_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A first start with [ha] names the new data directory's replica (ha-replica.json) before ZooKeeper
    can refuse it (its id live elsewhere, another shard count than its peers'). Started again with the
    id the refusal asked for, that directory, which held nothing, was refused as another replica's
    ("its schedule is another replica's") and had to be deleted by hand. One that stored something
    still is."""
    import timewheel.app.service as service_module
    from coordination import HAConfig, ReplicaIdTaken, ShardReplica
    from storage import Record
    from timewheel.app.service import StartError

    def taken(self: ShardReplica, *args: Any, **kwargs: Any) -> ShardReplica:
        raise ReplicaIdTaken(f"ha.replica_id = {self.cfg.replica_id!r} is already live in shard 0 (another process "
                             "holds it): give each replica of a shard its own id")

    monkeypatch.setattr(service_module, "check_zookeeper_reachable", lambda connect: None)
    monkeypatch.setattr(ShardReplica, "start", taken)
    data = tmp_path / "data"

    def refused(replica_id: str) -> str:
        service = Service(Settings(engine=EngineConfig(data), rocketmq=RocketMQConfig(namesrv="127.0.0.1:9"),
                                   admin=AdminConfig(listen="127.0.0.1:0"),
                                   ha=HAConfig(zookeeper="127.0.0.1:9", replica_id=replica_id)))
        with pytest.raises(StartError) as raised:
            service.start()
        return str(raised.value)

    assert "'a' is already live" in refused("a")
    assert "'b' is already live" in refused("b")  # its own refusal, not the directory's
    with ScheduleStore(data) as store:  # now it holds a message: it is replica b's
        store.append([Record("m1", "ORDERS", b"x", 1_800_000_000_000)], 1_800_000_000_000 - 1000)
    said = refused("c")
    assert "belongs to replica 'b'" in said, said
