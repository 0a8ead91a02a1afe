"""Settings: keys that were removed are refused with what to do instead."""
from __future__ import annotations

from pathlib import Path

import pytest

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
