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
