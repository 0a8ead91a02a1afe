"""The engine's typed configuration."""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from os import PathLike
from pathlib import Path
from typing import Literal

from storage import TWO_YEARS_MS
from timewheel.errors import ConfigError

_MAX_ATTEMPTS = 1000
_DAY_MS = 86_400_000
#: the longest `max_delay_ms` may be: 100 years (segment directories are named up to year 9999)
MAX_DELAY_LIMIT_MS = 36_525 * 86_400_000
#: the largest body the engine takes by default: RocketMQ's 4 MiB message less 64 KiB for its
#: properties, so that what is stored can be delivered and dead-lettered whole
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024 - 64 * 1024
#: tombstones held at most (each costs ~150 bytes of memory beside its text)
MAX_TOMBSTONES = 50_000_000


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to know; field names are the TOML keys of `[engine]`."""

    data_dir: Path
    tick_ms: int = 500
    segment_minutes: int = 60
    preload_seconds: int = 120
    flush: Literal["async", "sync"] = "async"
    max_delay_ms: int = TWO_YEARS_MS
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_attempts: int = 16
    retry_base_ms: int = 1_000
    retry_max_ms: int = 60_000
    send_batch_size: int = 256
    checkpoint_seconds: float = 10.0
    rescan_seconds: float = 2.0
    catch_up_chunk: int = 20_000
    retention_hours: float = 0.0  # 0 keeps every segment; >0 retires fully dispatched ones this old
    # how long a cancel is kept for messages that arrive after it (longer than the delay topic's
    # retention plus producer retries: a message cannot arrive later than that)
    tombstone_retention_hours: float = 168.0
    max_tombstones: int = 1_000_000
    # the meta store's block cache (ids, keys, locations read from its files), in MiB
    meta_cache_mb: int = 32
    # fault drills only: the service reads the time as the machine's clock plus this (a skewed host)
    clock_offset_ms: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.data_dir, (str, PathLike)) or not str(self.data_dir).strip():
            raise ConfigError(f"engine.data_dir = {self.data_dir!r} is invalid: it must name a directory "
                              f"(for example --data-dir var/data)")
        object.__setattr__(self, "data_dir", Path(self.data_dir))
        for name in ("checkpoint_seconds", "rescan_seconds", "retention_hours", "tombstone_retention_hours"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ConfigError(f"engine.{name} = {value!r} is invalid: it must be a finite number")
        checks = [
            ("tick_ms", 1 <= self.tick_ms <= 60_000, "between 1 and 60000"),
            ("segment_minutes", self.segment_minutes > 0 and 1440 % self.segment_minutes == 0,
             "a divisor of 1440 (minutes in a day)"),
            ("preload_seconds", 0 <= self.preload_seconds * 1000 < self.segment_minutes * 60_000,
             "at least 0 and shorter than a segment"),
            ("flush", self.flush in ("async", "sync"), '"async" or "sync"'),
            ("max_delay_ms", 0 < self.max_delay_ms <= MAX_DELAY_LIMIT_MS,
             f"between 1 and {MAX_DELAY_LIMIT_MS} (100 years)"),
            ("max_body_bytes", 0 < self.max_body_bytes <= 64 * 1024 * 1024, "between 1 and 67108864"),
            # attempts are counted in int16 arrays
            ("max_attempts", 1 <= self.max_attempts <= _MAX_ATTEMPTS, f"between 1 and {_MAX_ATTEMPTS}"),
            # the backoff is computed in int64 (base × 2^30 at most): past a day it would overflow or mean nothing
            ("retry_base_ms", 0 <= self.retry_base_ms <= _DAY_MS, f"between 0 and {_DAY_MS} (a day)"),
            ("retry_max_ms", self.retry_base_ms <= self.retry_max_ms <= _DAY_MS,
             f"between retry_base_ms and {_DAY_MS} (a day)"),
            ("send_batch_size", self.send_batch_size >= 1, "at least 1"),
            ("checkpoint_seconds", 0 < self.checkpoint_seconds <= 3600, "positive, at most 3600"),
            ("rescan_seconds", 0 < self.rescan_seconds <= 3600, "positive, at most 3600"),
            ("catch_up_chunk", self.catch_up_chunk >= 1, "at least 1"),
            ("retention_hours", self.retention_hours >= 0, "at least 0"),
            ("tombstone_retention_hours", 0 < self.tombstone_retention_hours <= 24 * 365 * 10,
             "positive, at most 87600 (ten years)"),
            ("clock_offset_ms", abs(self.clock_offset_ms) <= 86_400_000, "between -86400000 and 86400000 (a day)"),
            ("meta_cache_mb", 1 <= self.meta_cache_mb <= 1 << 20, "between 1 and 1048576 (1 TiB)"),
            ("max_tombstones", 1 <= self.max_tombstones <= MAX_TOMBSTONES,
             f"at least 1 and at most {MAX_TOMBSTONES} (held in memory)"),
        ]
        for name, ok, want in checks:
            if not ok:
                raise ConfigError(f"engine.{name} = {getattr(self, name)!r} is invalid: it must be {want}")

    @property
    def segment_ms(self) -> int:
        """Segment length in ms."""
        return self.segment_minutes * 60_000

    @property
    def tombstone_retention_ms(self) -> int:
        """How long a cancel is kept as a tombstone, in ms."""
        return int(self.tombstone_retention_hours * 3_600_000)

    @classmethod
    def field_names(cls) -> list[str]:
        """Names of the fields, as accepted in the config file."""
        return [f.name for f in fields(cls)]
