"""`broker`, `zookeeper`, `demo` and `send` given an input they cannot use: one line saying what is
wrong and what to give, exit 2, before any broker, ZooKeeper or JVM starts and before any send."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
from typer.testing import CliRunner

import coordination.local_zookeeper as local_zookeeper
from tests.timewheel.app._refusals import refused
import forwarder
import forwarder._rmq_native as native
import forwarder.local_rocketmq as local_rocketmq
from timewheel.app.cli import app



def _not_a_directory(tmp_path: Path, kind: str) -> Path:
    """A --dir that cannot be a directory: a regular file, or a path below one."""
    f = tmp_path / "store.txt"
    f.write_text("not a directory")
    return f if kind == "a file" else f / "run"


@pytest.fixture
def java_looked_for(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Which local servers looked for java (which runs `java -version`, a JVM) on their way to start."""
    calls: list[str] = []

    def recording(module: Any, name: str) -> Callable[[], str]:
        real = module.find_java

        def find_java() -> str:
            calls.append(name)
            return str(real())
        return find_java

    monkeypatch.setattr(local_rocketmq, "find_java", recording(local_rocketmq, "broker"))
    monkeypatch.setattr(local_zookeeper, "find_java", recording(local_zookeeper, "zookeeper"))
    return calls


@pytest.mark.parametrize("kind", ["a file", "below a file"])
@pytest.mark.parametrize("command", ["broker", "zookeeper"])
def test_a_run_directory_that_cannot_be_a_directory_is_refused_before_any_jvm(
        tmp_path: Path, java_looked_for: list[str], command: str, kind: str) -> None:
    run_dir = _not_a_directory(tmp_path, kind)
    res = CliRunner().invoke(app, [command, "--dir", str(run_dir)])
    refused(res, str(run_dir), "not a directory" if kind == "a file" else "Not a directory", "give a directory")
    assert java_looked_for == []
    assert (tmp_path / "store.txt").read_text() == "not a directory"


@pytest.fixture
def no_local_rocketmq(monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo must refuse these inputs before its RocketMQ starts."""

    def no_broker(*args: object, **kwargs: object) -> None:
        raise AssertionError("the demo started a RocketMQ for an input it refuses")

    monkeypatch.setattr(forwarder, "LocalRocketMQ", no_broker)


@pytest.mark.parametrize("option,value,want", [
    ("--rate", "0", "at least 1"), ("--rate", "-5", "at least 1"),
    ("--duration", "0", "above 0"), ("--duration", "-1", "above 0"), ("--duration", "nan", "above 0"),
    ("--duration", "inf", "finite"),
])
def test_a_demo_rate_or_duration_out_of_range_is_refused_before_anything_starts(
        no_local_rocketmq: None, option: str, value: str, want: str) -> None:
    res = CliRunner().invoke(app, ["demo", option, value])
    refused(res, f"{option} {value} is invalid: it must be", want)


class _NoProducer:
    """Stands in for the native producer: a refused send must never make one."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("a producer was started for a NameServer address the command refuses")


@pytest.mark.parametrize("namesrv", ["garbage", "127.0.0.1", ":9876", "127.0.0.1:0", "127.0.0.1:65536",
                                     "127.0.0.1:98x6", "127.0.0.1:9876;"])
def test_send_refuses_a_name_server_that_is_not_host_port_as_serve_does(monkeypatch: pytest.MonkeyPatch,
                                                                       namesrv: str) -> None:
    monkeypatch.setattr(native, "NativeProducer", _NoProducer)
    res = CliRunner().invoke(app, ["send", "--namesrv", namesrv, "--topic", "ORDERS", "--delay", "30s",
                                   "--body", "hello"])
    refused(res, "--namesrv", repr(namesrv), "it must be HOST:PORT")
    served = CliRunner().invoke(app, ["serve", "--namesrv", namesrv, "--data-dir", "data", "--print-config"])
    assert served.exit_code == 2 and "it must be HOST:PORT" in served.output, served.output


def test_send_refuses_a_name_server_that_is_not_utf8(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "NativeProducer", _NoProducer)
    namesrv = b"broker-\xff:9876".decode("utf-8", "surrogateescape")  # what Python makes of such bytes in argv
    res = CliRunner().invoke(app, ["send", "--namesrv", namesrv, "--topic", "ORDERS", "--delay", "30s",
                                   "--body", "hello"])
    refused(res, "--namesrv", "is not valid UTF-8")
