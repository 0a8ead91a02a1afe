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
