"""A file the `[rocketmq]` settings name that cannot be used (the ACL secret's, the TLS CAs') stops
`serve` in one line, exit 2, naming the key and the file, with nothing left running. A missing
`secret_key_file` once surfaced as a traceback (exit 1) from the middle of the start; so did a
`tls_ca_file` removed after the configuration was loaded."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from forwarder.config import RocketMQConfig
from storage import ScheduleStore
from tests.forwarder.rocketmq._ca_file import make_ca_file
from timewheel.app.service import Service
from timewheel.app.settings import AdminConfig, Settings
from timewheel.config import EngineConfig
from timewheel.errors import ConfigError

ROOT = Path(__file__).resolve().parents[3]


def _serve(*args: str) -> subprocess.CompletedProcess[str]:
    """`python ARGS` in a clean environment, as an operator's shell runs it."""
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})


def _refused_in_one_line(out: subprocess.CompletedProcess[str], *words: str, started: bool = False) -> None:
    """Exit 2, one `timewheel: ...` line on stderr holding each of `words`, no traceback; after the
    start's own log lines when it `started`, else alone."""
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    assert lines and lines[-1].startswith("timewheel: "), out.stderr[-2000:]
    assert len(lines) == 1 or started and [line for line in lines if line.startswith("timewheel: ")] == lines[-1:], \
        out.stderr[-2000:]
    for w in words:
        assert w in lines[-1], lines[-1]


def test_serve_with_a_missing_secret_key_file_is_refused_in_one_line(tmp_path: Path) -> None:
    secret = tmp_path / "no-such-secret"
    config = tmp_path / "timewheel.toml"
    config.write_text(f'[rocketmq]\nnamesrv = "127.0.0.1:9"\naccess_key = "engine"\nsecret_key_file = "{secret}"\n'
                      f'[admin]\nlisten = "127.0.0.1:0"\n')
    data = tmp_path / "data"
    out = _serve("-m", "timewheel", "serve", "--config", str(config), "--data-dir", str(data))
    _refused_in_one_line(out, "rocketmq.secret_key_file", repr(str(secret)), "no such file")
    ScheduleStore(data).close()  # nothing holds the data directory


def test_serve_whose_ca_file_went_away_after_the_config_was_loaded_is_refused_in_one_line(tmp_path: Path) -> None:
    """The load-time check cannot see a file removed after it: the start's own refusal is said the same way."""
    ca = make_ca_file(tmp_path)
    config = tmp_path / "timewheel.toml"
    config.write_text(f'[rocketmq]\nnamesrv = "127.0.0.1:9"\ntls = true\ntls_ca_file = "{ca}"\n'
                      f'[admin]\nlisten = "127.0.0.1:0"\n')
    data = tmp_path / "data"
    # the real command, with the CA file removed right after its configuration is loaded
    removed_after_load = (
        "import os, timewheel.app.settings as s\n"
        "load = s.load_settings\n"
        "def loaded_then_removed(*a, **k):\n"
        "    settings = load(*a, **k)\n"
        f"    os.remove({str(ca)!r})\n"
        "    return settings\n"
        "s.load_settings = loaded_then_removed\n"
        "from timewheel.app.cli import main\n"
        "main()\n")
    out = _serve("-c", removed_after_load, "serve", "--config", str(config), "--data-dir", str(data))
    _refused_in_one_line(out, "rocketmq.tls_ca_file", repr(str(ca)), "no such file", started=True)
    assert not ca.exists()  # the start did meet the file gone
    ScheduleStore(data).close()


def _service_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith(("timewheel-", "ingest-")))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="descriptors are counted through /proc")
def test_a_secret_key_file_gone_at_start_stops_it_with_nothing_left_running(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    rmq = RocketMQConfig(namesrv="127.0.0.1:9", access_key="engine", secret_key_file=str(secret))
    secret.unlink()
    data = tmp_path / "data"
    threads, fds = _service_threads(), set(os.listdir("/proc/self/fd"))
    service = Service(Settings(engine=EngineConfig(data), rocketmq=rmq, admin=AdminConfig(listen="127.0.0.1:0")))
    with pytest.raises(ConfigError, match="rocketmq.secret_key_file"):
        service.start()
    assert service.engine is None and service.admin is None
    assert set(_service_threads()) <= set(threads)
    assert set(os.listdir("/proc/self/fd")) <= fds
    ScheduleStore(data).close()
