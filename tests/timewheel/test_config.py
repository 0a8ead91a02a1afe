"""The engine's configuration refuses values that cannot work, naming the key."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from timewheel import ConfigError, EngineConfig
from timewheel.config import MAX_DELAY_LIMIT_MS


@pytest.mark.parametrize("changes,names", [
    pytest.param({"data_dir": ""}, "engine.data_dir = ''", id="empty-data-dir"),
    pytest.param({"data_dir": "  "}, "engine.data_dir", id="blank-data-dir"),
    pytest.param({"checkpoint_seconds": float("inf")}, "engine.checkpoint_seconds = inf", id="infinite-checkpoint"),
    pytest.param({"checkpoint_seconds": float("nan")}, "engine.checkpoint_seconds = nan", id="nan-checkpoint"),
    pytest.param({"checkpoint_seconds": 1e12}, "engine.checkpoint_seconds", id="checkpoint-past-an-hour"),
    pytest.param({"retention_hours": float("inf")}, "engine.retention_hours = inf", id="infinite-retention"),
    pytest.param({"rescan_seconds": float("inf")}, "engine.rescan_seconds = inf", id="infinite-rescan"),
    pytest.param({"max_attempts": 40_000}, "engine.max_attempts = 40000", id="attempts-past-int16"),
    pytest.param({"max_attempts": 0}, "engine.max_attempts = 0", id="no-attempts"),
])
def test_values_that_cannot_work_are_refused(tmp_path: Path, changes: dict[str, Any], names: str) -> None:
    kwargs: dict[str, Any] = {"data_dir": tmp_path, **changes}
    with pytest.raises(ConfigError) as err:
        EngineConfig(**kwargs)
    assert names in str(err.value)


def test_defaults_are_valid(tmp_path: Path) -> None:
    cfg = EngineConfig(str(tmp_path))  # type: ignore[arg-type]  # a str is taken as a Path
    assert cfg.data_dir == tmp_path and cfg.max_attempts == 16


@pytest.mark.parametrize("ms, ok", [(MAX_DELAY_LIMIT_MS, True), (MAX_DELAY_LIMIT_MS + 1, False), (10**22, False)])
def test_max_delay_at_its_limit_and_past_it(tmp_path: Path, ms: int, ok: bool) -> None:
    # a due time past year 9999 makes a segment directory no start reads back: stored, never sent
    if ok:
        assert EngineConfig(tmp_path, max_delay_ms=ms).max_delay_ms == ms
    else:
        with pytest.raises(ConfigError, match="max_delay_ms"):
            EngineConfig(tmp_path, max_delay_ms=ms)


@pytest.mark.parametrize("changes, ok", [({"retry_max_ms": 86_400_000}, True), ({"retry_max_ms": 86_400_001}, False),
                                         ({"retry_max_ms": 2**63}, False),
                                         ({"retry_base_ms": 9_000_000_000, "retry_max_ms": 9_000_000_000}, False)])
def test_retry_backoff_at_its_limit_and_past_it(tmp_path: Path, changes: dict[str, int], ok: bool) -> None:
    # past them a failed send's backoff overflowed (OverflowError stopped the engine) or wrapped negative
    if ok:
        assert EngineConfig(tmp_path, **changes).retry_max_ms == changes["retry_max_ms"]  # type: ignore[arg-type]
    else:
        with pytest.raises(ConfigError, match="retry_"):
            EngineConfig(tmp_path, **changes)  # type: ignore[arg-type]
