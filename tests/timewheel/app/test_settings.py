"""Settings: keys that were removed are refused with what to do instead."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.forwarder.rocketmq._ca_file import make_ca_file
from timewheel.app.settings import load_settings
from timewheel.errors import ConfigError


@pytest.mark.parametrize("key, value", [("ingest_client", '"push"'), ("consume_threads", "4")])
def test_a_removed_rocketmq_key_is_refused_saying_it_was_removed(tmp_path: Path, key: str, value: str) -> None:
    path = tmp_path / "timewheel.toml"
    path.write_text(f'[engine]\ndata_dir = "{tmp_path}"\n[rocketmq]\n{key} = {value}\n')
    with pytest.raises(ConfigError, match=f"rocketmq.{key} was removed.*delete the key"):
        load_settings(path, env={})


def test_the_same_file_without_it_loads(tmp_path: Path) -> None:
    path = tmp_path / "timewheel.toml"
    path.write_text(f'[engine]\ndata_dir = "{tmp_path}"\n[rocketmq]\nconsume_batch = 64\n')
    assert load_settings(path, env={}).rocketmq.consume_batch == 64


def test_bad_traffic_rules_are_refused_when_the_config_is_loaded(tmp_path: Path) -> None:
    cfg = tmp_path / "timewheel.toml"
    cfg.write_text('[engine]\ndata_dir = "d"\n\n[shaping.topics.ORDERS]\nrate = 1e-320\n')
    with pytest.raises(ConfigError, match="shaping.topics.ORDERS.rate"):
        load_settings(cfg, {})


def test_the_ha_section_comes_from_the_file_the_environment_and_shows_in_print_config(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    path = tmp_path / "timewheel.toml"
    path.write_text(f'[engine]\ndata_dir = "{tmp_path}"\n[ha]\nzookeeper = "127.0.0.1:2181"\nshards = 4\n'
                    f'shard = 3\nsession_timeout_s = 8\n')
    settings = load_settings(path, env={"TIMEWHEEL_HA_REPLICA_ID": "east-1"})
    assert (settings.ha.shards, settings.ha.shard, settings.ha.replica_id, settings.ha.session_timeout_s) == \
        (4, 3, "east-1", 8.0)
    with pytest.raises(ConfigError, match=r"ha\.replica_id = ''.*when ha\.zookeeper is set"):
        load_settings(path, env={})
    with pytest.raises(ConfigError, match=r"ha\.shard = 3 is invalid"):
        load_settings(path, env={"TIMEWHEEL_HA_REPLICA_ID": "a", "TIMEWHEEL_HA_SHARDS": "2"})
    out = subprocess.run([sys.executable, "-m", "timewheel", "serve", "--config", str(path), "--print-config"],
                         capture_output=True, text=True, timeout=60, check=True,
                         env={"TIMEWHEEL_HA_REPLICA_ID": "east-1", "PATH": "/usr/bin:/bin",
                              "PYTHONPATH": str(Path(__file__).resolve().parents[3])})
    ha = json.loads(out.stdout)["ha"]
    assert ha["zookeeper"] == "127.0.0.1:2181" and ha["shard"] == 3 and ha["replica_id"] == "east-1"


@pytest.mark.parametrize("section, lines, key, why", [
    pytest.param("rocketmq", ['tls_ca_file = "/etc/ssl/certs/ca-certificates.crt"'], "rocketmq.tls_ca_file",
                 "unless tls = true", id="ca-file-without-tls"),
    pytest.param("rocketmq", ["tls_verify = true"], "rocketmq.tls_verify", "tls = true", id="verify-without-tls"),
    pytest.param("rocketmq", ["tls_insecure = true"], "rocketmq.tls_insecure", "unless tls = true",
                 id="insecure-without-tls"),
    pytest.param("rocketmq", ["tls = true", "tls_verify = false"], "rocketmq.tls_verify", "tls_insecure",
                 id="verify-off-without-saying-insecure"),
    pytest.param("rocketmq", ["tls = true", 'tls_ca_file = "/nonexistent/ca.pem"'], "rocketmq.tls_ca_file",
                 "readable PEM", id="a-ca-file-that-is-not-there"),
    pytest.param("rocketmq", ['namesrv = ";"'], "rocketmq.namesrv", "HOST:PORT", id="namesrv-only-separators"),
    pytest.param("rocketmq", ['namesrv = "127.0.0.1:9876;nohost"'], "rocketmq.namesrv", "HOST:PORT",
                 id="namesrv-one-bad-of-two"),
    pytest.param("rocketmq", ['namesrv = "127.0.0.1:\uff19\uff18\uff17\uff16"'], "rocketmq.namesrv", "HOST:PORT",
                 id="namesrv-port-in-full-width-digits"),
    pytest.param("rocketmq", ['dead_letter_topic = "%DLQ%orders"'], "rocketmq.dead_letter_topic", "system topic",
                 id="dead-letter-topic-a-system-topic"),
    pytest.param("rocketmq", ['delay_topic = "SCHEDULE_TOPIC_XXXX"'], "rocketmq.delay_topic", "system topic",
                 id="delay-topic-a-system-topic"),
    pytest.param("engine", ["max_tombstones = 1000000000000"], "engine.max_tombstones", "at most",
                 id="unbounded-tombstones"),
    pytest.param("engine", ["max_body_bytes = 4194304"], "engine.max_body_bytes", "delivery",
                 id="bodies-delivery-cannot-send"),
    pytest.param("engine", ["meta_cache_mb = 0"], "engine.meta_cache_mb", "between 1", id="no-meta-cache"),
])
def test_settings_that_cannot_work_are_refused_with_the_key_and_why(tmp_path: Path, section: str, lines: list[str],
                                                                     key: str, why: str) -> None:
    path = tmp_path / "timewheel.toml"
    body = "\n".join(lines)
    engine = body if section == "engine" else ""
    rocketmq = body if section == "rocketmq" else ""
    path.write_text(f'[engine]\ndata_dir = "{tmp_path}"\n{engine}\n[rocketmq]\n{rocketmq}\n')
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
        load_settings(path, env={})
    assert why in str(e.value)


def test_the_defaults_and_a_tls_setup_with_a_ca_file_load(tmp_path: Path) -> None:
    ca = make_ca_file(tmp_path)  # loaded at start: a file that holds no certificate is refused
    path = tmp_path / "timewheel.toml"
    path.write_text(f'[engine]\ndata_dir = "{tmp_path}"\n[rocketmq]\ntls = true\ntls_ca_file = "{ca}"\n'
                    f'namesrv = "10.0.0.1:9876;10.0.0.2:9876"\n')
    s = load_settings(path, env={})
    assert s.rocketmq.tls and not s.rocketmq.tls_insecure
    from timewheel.config import EngineConfig
    from forwarder.contract import DEAD_LETTER_MAX_BODY
    assert EngineConfig(tmp_path).max_body_bytes == DEAD_LETTER_MAX_BODY


@pytest.mark.parametrize("key", ["secret_key", "token"])
def test_a_secret_that_is_not_a_string_is_not_echoed(tmp_path: Path, key: str) -> None:
    section = "admin" if key == "token" else "rocketmq"
    path = tmp_path / "timewheel.toml"
    path.write_text(f'[engine]\ndata_dir = "{tmp_path}"\n[{section}]\n{key} = ["hunter2-very-secret"]\n')
    with pytest.raises(ConfigError, match=f"{section}.{key}") as e:
        load_settings(path, env={})
    assert "hunter2" not in str(e.value)


def test_serve_with_zookeeper_unreachable_says_so_without_a_traceback(tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = tmp_path / "timewheel.toml"
    path.write_text(f'[engine]\ndata_dir = "{tmp_path / "data"}"\n[admin]\nlisten = "127.0.0.1:0"\n'
                    f'[ha]\nzookeeper = "127.0.0.1:{port}"\nreplica_id = "r1"\n')
    out = subprocess.run([sys.executable, "-m", "timewheel", "serve", "--config", str(path)], capture_output=True,
                         text=True, timeout=120, env={"PATH": "/usr/bin:/bin",
                                                      "PYTHONPATH": str(Path(__file__).resolve().parents[3])})
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"cannot reach ZooKeeper at ha.zookeeper = '127.0.0.1:{port}'" in out.stderr
    assert "Traceback" not in out.stderr


def test_serve_with_no_nameserver_says_so_in_one_line_and_closes_its_store(tmp_path: Path) -> None:
    """It once died with a fifty-line traceback from inside the consumer's first rebalance."""
    import socket
    import subprocess
    import sys

    from storage import ScheduleStore

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run([sys.executable, "-m", "timewheel", "serve", "--data-dir", str(tmp_path / "data"),
                          "--namesrv", f"127.0.0.1:{port}", "--admin", "127.0.0.1:0"], capture_output=True, text=True,
                         timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[3])})
    assert out.returncode == 2, out.stderr[-2000:]
    assert f"cannot start consuming TW_DELAY through the NameServer at 127.0.0.1:{port}" in out.stderr
    assert "Connection refused" in out.stderr and "Traceback" not in out.stderr
    ScheduleStore(tmp_path / "data").close()  # closed cleanly: nothing holds its lock


def test_serve_on_a_data_directory_another_engine_holds_says_so_in_one_line(tmp_path: Path) -> None:
    """The meta store's lock refused the open: the reason came after a traceback."""
    import subprocess
    import sys

    from storage import ScheduleStore

    held = ScheduleStore(tmp_path / "data")
    try:
        out = subprocess.run([sys.executable, "-m", "timewheel", "serve", "--data-dir", str(tmp_path / "data"),
                              "--namesrv", "127.0.0.1:9", "--admin", "127.0.0.1:0"], capture_output=True, text=True,
                             timeout=120,
                             env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(__file__).resolve().parents[3])})
    finally:
        held.close()
    assert out.returncode == 2, out.stderr[-2000:]
    assert "is in use by another engine (its meta store is locked)" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_clock_offset_for_fault_drills_skews_the_service_clock_and_nothing_else(tmp_path: Path) -> None:
    import time

    from timewheel.app.service import Service
    from timewheel.clock import SystemClock, seconds_until

    settings = load_settings(None, env={"TIMEWHEEL_ENGINE_DATA_DIR": str(tmp_path),
                                        "TIMEWHEEL_ENGINE_CLOCK_OFFSET_MS": "-3000"})
    clock = Service(settings, admin=False).clock
    assert isinstance(clock, SystemClock) and clock.offset_ms == -3000
    assert abs(clock.now_ms() - (time.time_ns() // 1_000_000 - 3000)) < 200
    assert 0.5 < seconds_until(clock, clock.now_ms() + 1000, 5.0) <= 1.0  # waits are read on the skewed clock
    unskewed = Service(load_settings(None, env={"TIMEWHEEL_ENGINE_DATA_DIR": str(tmp_path)}), admin=False).clock
    assert isinstance(unskewed, SystemClock) and unskewed.offset_ms == 0
    with pytest.raises(ConfigError, match="engine.clock_offset_ms"):
        load_settings(None, env={"TIMEWHEEL_ENGINE_DATA_DIR": str(tmp_path),
                                 "TIMEWHEEL_ENGINE_CLOCK_OFFSET_MS": str(2 * 86_400_000)})


@pytest.mark.parametrize(("value", "ok"), [("1", True), ("86400", True), ("0.5", False), ("86401", False), ("0", False)])
def test_consume_refused_max_s_at_its_limits_and_past_them(tmp_path: Path, value: str, ok: bool) -> None:
    env = {"TIMEWHEEL_ENGINE_DATA_DIR": str(tmp_path), "TIMEWHEEL_ROCKETMQ_CONSUME_REFUSED_MAX_S": value}
    if ok:
        assert load_settings(None, env=env).rocketmq.consume_refused_max_s == float(value)
    else:
        with pytest.raises(ConfigError, match=r"rocketmq\.consume_refused_max_s.*between 1 and 86400"):
            load_settings(None, env=env)


@pytest.mark.parametrize("source", ["environment", "file"])
def test_an_empty_data_dir_is_refused_not_taken_for_the_working_directory(tmp_path: Path, source: str) -> None:
    """An unset variable in a unit file or a container template gives an empty path, which Path()
    reads as "." (the engine would make its store in whatever directory it was started in)."""
    path = tmp_path / "timewheel.toml"
    path.write_text('[engine]\ndata_dir = ""\n' if source == "file" else "")
    env = {"TIMEWHEEL_ENGINE_DATA_DIR": ""} if source == "environment" else {}
    with pytest.raises(ConfigError, match=r"engine\.data_dir = '' is invalid: it must name a directory"):
        load_settings(path, env=env)


@pytest.mark.parametrize("value", ["", "   "])
def test_serve_with_an_empty_data_dir_flag_refuses_it_in_one_line(tmp_path: Path, value: str) -> None:
    """`--data-dir "$DATA_DIR"` with the variable unset: one line and exit 2, nothing made in the cwd."""
    from typer.testing import CliRunner

    from timewheel.app.cli import app

    res = CliRunner().invoke(app, ["serve", "--data-dir", value, "--print-config"], env={})
    assert res.exit_code == 2, res.output
    assert res.output.strip().splitlines() == [f"timewheel: engine.data_dir = {value!r} is invalid: it must name a "
                                               "directory (for example --data-dir var/data)"], res.output


@pytest.mark.parametrize("line, key, why", [
    ("tls = [0]", "rocketmq.tls", "true or false"),  # bool([0]) is True: TLS turned on by a typo
    ("tls = 1", "rocketmq.tls", "true or false"),
    ('tls = "maybe"', "rocketmq.tls", "true or false"),
])
def test_a_switch_takes_true_or_false_and_nothing_that_merely_looks_true(tmp_path: Path, line: str, key: str,
                                                                       why: str) -> None:
    path = tmp_path / "timewheel.toml"
    path.write_text(f'[engine]\ndata_dir = "{tmp_path}"\n[rocketmq]\n{line}\n')
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
        load_settings(path, env={})
    assert why in str(e.value)


def test_a_number_is_not_a_switch(tmp_path: Path) -> None:
    path = tmp_path / "timewheel.toml"
    path.write_text(f'[engine]\ndata_dir = "{tmp_path}"\ncheckpoint_seconds = true\n')
    with pytest.raises(ConfigError, match=r"engine\.checkpoint_seconds = True is invalid: it must be a number"):
        load_settings(path, env={})


def test_a_section_written_as_a_value_says_so_not_that_it_is_unknown(tmp_path: Path) -> None:
    path = tmp_path / "timewheel.toml"
    path.write_text("engine = 5\n")
    with pytest.raises(ConfigError, match=r"engine = 5 .* is not a section: write its keys under \[engine\]"):
        load_settings(path, env={})


def test_switches_still_load_from_toml_and_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "timewheel.toml"
    path.write_text(f'[engine]\ndata_dir = "{tmp_path}"\n[rocketmq]\ntls = false\n')
    assert load_settings(path, env={}).rocketmq.tls is False
    assert load_settings(path, env={"TIMEWHEEL_ROCKETMQ_TLS": "no"}).rocketmq.tls is False
