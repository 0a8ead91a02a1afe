"""An admin address the service cannot listen on (a port another engine on the host holds, a host name
that is not this host's) stops the start in one line, before the delay topic is consumed, and leaves
nothing behind: no engine thread, no descriptor, no lock on the data directory. It once surfaced as a
bare OSError (a traceback, exit 1) after the engine had started consuming, with the engine left
running and its meta store locked, so that a start right after in the same process was refused."""
from __future__ import annotations

import os
import socket
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from forwarder.config import RocketMQConfig
from forwarder.ingest import DelayTopicIngest
from storage import ScheduleStore
from timewheel.app.service import Service, StartError
from timewheel.app.settings import AdminConfig, Settings
from timewheel.config import EngineConfig


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _service_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith(("timewheel-", "ingest-")))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="descriptors are counted through /proc")
def test_an_admin_port_in_use_stops_the_start_before_consuming_and_leaves_nothing_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    consumed: list[str] = []

    def start(self: DelayTopicIngest, schedule: Any, cancel: Any = None, encoded: Any = None) -> None:
        consumed.append(self.cfg.delay_topic)  # in place of joining the group: no broker here

    monkeypatch.setattr(DelayTopicIngest, "start", start)
    data = tmp_path / "data"
    rmq = RocketMQConfig(namesrv="127.0.0.1:9")  # nothing connects: ingest is the stand-in above
    threads, fds = _service_threads(), _open_fds()
    with socket.create_server(("127.0.0.1", 0)) as held:  # another engine's admin port on this host
        listen = f"127.0.0.1:{held.getsockname()[1]}"
        service = Service(Settings(engine=EngineConfig(data), rocketmq=rmq, admin=AdminConfig(listen=listen)))
        with pytest.raises(StartError) as refused:
            service.start()
    assert f"admin.listen = {listen!r}" in str(refused.value) and "Address already in use" in str(refused.value)
    assert consumed == []  # the group was never joined: nothing taken, nothing to hand back
    assert service.engine is None and service.admin is None
    # none left by this start; one an earlier test's admin server left may end meanwhile
    assert set(_service_threads()) <= set(threads)
    assert _open_fds() <= fds
    ScheduleStore(data).close()  # its meta store's lock was let go
    # a start right after, in the same process, on a port that is free
    again = Service(Settings(engine=EngineConfig(data), rocketmq=rmq, admin=AdminConfig(listen="127.0.0.1:0")))
    again.start()
    try:
        assert again.admin is not None and consumed == [rmq.delay_topic]
        with urllib.request.urlopen(f"http://{again.admin.address}/healthz", timeout=10) as answer:
            assert answer.status == 200  # bound before consuming, serving once started
    finally:
        again.stop()
    assert set(_service_threads()) <= set(threads)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="descriptors are counted through /proc")
def test_a_start_that_fails_after_the_admin_port_was_taken_lets_it_go(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from forwarder import RemotingError

    def start(self: DelayTopicIngest, schedule: Any, cancel: Any = None, encoded: Any = None) -> None:
        raise RemotingError("connection refused")

    monkeypatch.setattr(DelayTopicIngest, "start", start)
    with socket.socket() as probe:  # a free port, to see it free again after the failed start
        probe.bind(("127.0.0.1", 0))
        listen = f"127.0.0.1:{probe.getsockname()[1]}"
    threads, fds = _service_threads(), _open_fds()
    service = Service(Settings(engine=EngineConfig(tmp_path / "data"), rocketmq=RocketMQConfig(namesrv="127.0.0.1:9"),
                               admin=AdminConfig(listen=listen)))
    with pytest.raises(StartError, match="cannot start consuming"):
        service.start()
    assert service.admin is None and set(_service_threads()) <= set(threads)
    assert _open_fds() <= fds  # the listening socket and the server's event loop (its selector, its wake-up pipe)
    socket.create_server(("127.0.0.1", int(listen.rsplit(":", 1)[1]))).close()


def test_serve_with_its_admin_port_taken_says_so_in_one_line_and_exits_2(tmp_path: Path) -> None:
    import subprocess
    import sys

    with socket.create_server(("127.0.0.1", 0)) as held:
        listen = f"127.0.0.1:{held.getsockname()[1]}"
        out = subprocess.run([sys.executable, "-m", "timewheel", "serve", "--data-dir", str(tmp_path / "data"),
                              "--namesrv", "127.0.0.1:9", "--admin", listen], capture_output=True, text=True,
                             timeout=120,
                             env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[3])})
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"timewheel: cannot serve the admin endpoint on admin.listen = {listen!r}" in out.stderr
    assert "Traceback" not in out.stderr
    ScheduleStore(tmp_path / "data").close()  # closed cleanly: nothing holds its lock
