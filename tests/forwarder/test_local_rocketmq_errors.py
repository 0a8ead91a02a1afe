"""The local RocketMQ's errors when tools or the download are missing (no broker is started)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from forwarder.errors import LocalRocketMQError
from forwarder.local_rocketmq import LocalRocketMQ, default_cache_dir, ensure_distribution

@pytest.fixture
def no_tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A PATH holding nothing but what the test links into it, and an empty cache."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("TIMEWHEEL_CACHE_DIR", str(tmp_path / "cache"))
    return bin_dir


def test_missing_java_is_one_clear_line(no_tools: Path) -> None:
    with pytest.raises(LocalRocketMQError) as info:
        LocalRocketMQ().start()
    assert "java" in str(info.value) and "\n" not in str(info.value)


def test_missing_mvn_is_one_clear_line(no_tools: Path, tmp_path: Path) -> None:
    with pytest.raises(LocalRocketMQError) as info:
        ensure_distribution(tmp_path / "cache")
    message = str(info.value)
    assert "mvn" in message and "\n" not in message


def test_failed_download_leaves_no_half_cache(no_tools: Path, tmp_path: Path) -> None:
    fake_mvn = no_tools / "mvn"
    # Writes a jar into the output folder, then fails: nothing of it may reach the cache.
    fake_mvn.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do case "$a" in -DoutputDirectory=*) d="${a#-DoutputDirectory=}";; esac; done\n'
        'mkdir -p "$d" && touch "$d/rocketmq-broker-5.3.3.jar"\n'
        "echo '[ERROR] Could not transfer artifact: network unreachable'\n"
        "exit 1\n"
    )
    fake_mvn.chmod(fake_mvn.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(LocalRocketMQError, match="network unreachable") as info:
        ensure_distribution(tmp_path / "cache")
    assert "\n" not in str(info.value)
    home = tmp_path / "cache" / "rocketmq-5.3.3"
    assert not (home / "lib").exists()
    assert [p.name for p in home.iterdir()] == ["download.log"]


def test_cache_dir_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TIMEWHEEL_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("TIMEWHEEL_CACHE_DIR")
    assert default_cache_dir() == Path(os.path.expanduser("~")) / ".cache" / "timewheel"
