"""A stop runs every step even when one fails: a consumer that could not stop cleanly must not leave
the engine sending, the store locked and the admin port held; the first failure is raised at the end."""
from __future__ import annotations

import gc
import threading
from pathlib import Path
from typing import Any

import pytest

from forwarder.config import RocketMQConfig
from forwarder.ingest import DelayTopicIngest
from storage import ScheduleStore
from timewheel.app.service import Service
from timewheel.app.settings import AdminConfig, Settings
from timewheel.config import EngineConfig
from timewheel.engine import Engine


def _service_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith(("timewheel-", "ingest-")))


class _StuckConsumer(Exception):
    """The delay topic's consumer could not stop."""


def test_a_step_of_the_stop_that_fails_leaves_no_later_step_undone_and_is_raised_at_the_end(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(DelayTopicIngest, "start", lambda self, *a, **k: None)  # no broker here
    stuck, broken = _StuckConsumer("a pull thread did not end"), OSError(28, "No space left on device")

    def source_stop(self: DelayTopicIngest) -> None:
        raise stuck

    real_stop = Engine.stop

    def engine_stop(self: Engine) -> None:
        real_stop(self)
        raise broken  # the last checkpoint, say: logged, the first error is the one raised

    monkeypatch.setattr(DelayTopicIngest, "stop", source_stop)
    monkeypatch.setattr(Engine, "stop", engine_stop)
    data = tmp_path / "data"
    threads, callbacks = _service_threads(), list(gc.callbacks)
    service = Service(Settings(engine=EngineConfig(data), rocketmq=RocketMQConfig(namesrv="127.0.0.1:9"),
                               admin=AdminConfig(listen="127.0.0.1:0"))).start()
    assert service.engine is not None and service.admin is not None
    with pytest.raises(_StuckConsumer) as raised:
        service.stop()
    assert raised.value is stuck
    assert service.engine is None and service.admin is None and service.copy_finder is None
    # no engine thread left to send (a handler thread an earlier test's admin server left may end meanwhile)
    assert set(_service_threads()) <= set(threads) and gc.callbacks == callbacks
    ScheduleStore(data).close()  # the store was closed: its lock let go
    assert any(r.exc_info and r.exc_info[1] is broken for r in caplog.records)  # the second failure is logged
