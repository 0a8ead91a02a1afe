"""The whole configuration as one typed object: TOML file, then TIMEWHEEL_* environment, then flags.

    [engine]      EngineConfig fields (data_dir, tick_ms, flush, ...)
    [rocketmq]    RocketMQConfig fields (namesrv, delay_topic, ...)
    [admin]       listen = "127.0.0.1:9321", token = "..." (or TIMEWHEEL_ADMIN_TOKEN)
    [log]         format = "text" | "json", level = "INFO"
    [shaping]     traffic rules, validated by the shaper
    [ha]          HAConfig fields (zookeeper, shards, shard, replica_id, ...): run as one replica of a shard

Environment variables are TIMEWHEEL_<SECTION>_<KEY>, e.g. TIMEWHEEL_ENGINE_DATA_DIR. Unknown keys
and invalid values are refused with the key's name.
"""
from __future__ import annotations

import dataclasses
import os
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

from coordination.config import HAConfig
from forwarder.config import RocketMQConfig
from timewheel.config import EngineConfig
from timewheel.errors import ConfigError

DEFAULT_ADMIN = "127.0.0.1:9321"
SECRET_KEYS = {("admin", "token"), ("rocketmq", "secret_key")}


@dataclass(frozen=True)
class AdminConfig:
    """The admin HTTP endpoint; loopback unless told otherwise."""

    listen: str = DEFAULT_ADMIN
    token: str = ""

    def __post_init__(self) -> None:
        host, _, port = self.listen.rpartition(":")
        if not host or not port.isdigit() or not 0 <= int(port) < 65536:
            raise ConfigError(f"admin.listen = {self.listen!r} is invalid: it must be HOST:PORT")


@dataclass(frozen=True)
class LogConfig:
    """Logging format and level."""

    format: Literal["text", "json"] = "text"
    level: str = "INFO"

    def __post_init__(self) -> None:
        if self.format not in ("text", "json"):
            raise ConfigError(f'log.format = {self.format!r} is invalid: it must be "text" or "json"')
        if self.level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ConfigError(f"log.level = {self.level!r} is invalid: DEBUG, INFO, WARNING or ERROR")


@dataclass(frozen=True)
class Settings:
    """Everything `timewheel serve` runs with."""

    engine: EngineConfig
    rocketmq: RocketMQConfig = field(default_factory=RocketMQConfig)
    admin: AdminConfig = field(default_factory=AdminConfig)
    log: LogConfig = field(default_factory=LogConfig)
    shaping: Mapping[str, Any] = field(default_factory=dict)
    ha: HAConfig = field(default_factory=HAConfig)

    def __post_init__(self) -> None:
        from forwarder.contract import DEAD_LETTER_MAX_BODY

        # what the engine stores must be what delivery (and the dead letter) can send
        if self.engine.max_body_bytes > DEAD_LETTER_MAX_BODY:
            raise ConfigError(f"engine.max_body_bytes = {self.engine.max_body_bytes} is invalid: it must be at most "
                              f"{DEAD_LETTER_MAX_BODY}, what delivery can send (RocketMQ's 4 MiB message less room "
                              f"for its properties)")

    def redacted(self) -> dict[str, dict[str, Any]]:
        """The effective settings as plain data, secrets replaced by "***"."""
        out: dict[str, dict[str, Any]] = {}
        for name in ("engine", "rocketmq", "admin", "log", "ha"):
            section = dataclasses.asdict(getattr(self, name))
            for k, v in section.items():
                if isinstance(v, Path):
                    section[k] = str(v)
                if (name, k) in SECRET_KEYS and v:
                    section[k] = "***"
            out[name] = section
        out["shaping"] = dict(self.shaping)
        return out


_SECTIONS: dict[str, type] = {"engine": EngineConfig, "rocketmq": RocketMQConfig, "admin": AdminConfig,
                              "log": LogConfig, "ha": HAConfig}


def _coerce(section: str, key: str, value: Any, typ: Any) -> Any:
    """Turn a TOML or environment value into the field's type, naming the key on failure."""
    origin = typing.get_origin(typ)
    try:
        if origin is Literal:
            if value not in typing.get_args(typ):
                raise ValueError(f"one of {', '.join(map(repr, typing.get_args(typ)))}")
            return value
        if typ is bool:
            if isinstance(value, str):
                if value.lower() not in ("1", "0", "true", "false", "yes", "no"):
                    raise ValueError("true or false")
                return value.lower() in ("1", "true", "yes")
            if not isinstance(value, bool):  # bool([0]) is True: a typo must not turn TLS on
                raise ValueError("true or false")
            return value
        if typ is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError("an integer")
            try:
                return int(value)
            except ValueError:
                raise ValueError("an integer") from None
        if typ is float:
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise ValueError("a number")
            try:
                return float(value)
            except ValueError:
                raise ValueError("a number") from None
        if typ is Path:
            # Path("") is "." (the directory the process started in): a blank or non-text value goes on
            # as it is, for the section's own check to refuse with what to give instead
            return Path(value) if isinstance(value, str) and value.strip() else value
        if typ is str:
            if not isinstance(value, (str, int, float)):
                raise ValueError("a string")
            return str(value)
    except (TypeError, ValueError) as e:
        shown = "<redacted>" if (section, key) in SECRET_KEYS else repr(value)
        raise ConfigError(f"{section}.{key} = {shown} is invalid: it must be {e}") from e
    return value


def load_settings(path: Path | None = None, env: Mapping[str, str] | None = None,
                  overrides: Mapping[str, Mapping[str, Any]] | None = None) -> Settings:
    """Read the TOML file (if any), then TIMEWHEEL_* variables, then `overrides` (flags)."""
    raw: dict[str, dict[str, Any]] = {name: {} for name in (*_SECTIONS, "shaping")}
    if path is not None:
        try:
            doc = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError as e:
            raise ConfigError(f"config file {path} does not exist") from e
        except IsADirectoryError as e:
            raise ConfigError(f"config file {path} is a directory: give the TOML file itself") from e
        except OSError as e:
            raise ConfigError(f"cannot read config file {path} ({e.strerror or e}): check that it is a file this "
                              "user can read") from e
        except UnicodeDecodeError as e:  # TOML is UTF-8 by definition
            raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start}): save it as UTF-8") from e
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from e
        for section, values in doc.items():
            if section not in raw:
                raise ConfigError(f"unknown config section [{section}] in {path}; known: "
                                  f"{', '.join(sorted(raw))}")
            if not isinstance(values, dict):
                raise ConfigError(f"{section} = {values!r} in {path} is not a section: write its keys under "
                                  f"[{section}]")
            raw[section].update(values)
    env = os.environ if env is None else env
    for name, value in env.items():
        if not name.startswith("TIMEWHEEL_") or name in ("TIMEWHEEL_CACHE_DIR",):
            continue
        rest = name[len("TIMEWHEEL_"):].lower()
        section, _, key = rest.partition("_")
        if section not in _SECTIONS or not key:
            raise ConfigError(f"unknown environment variable {name}: expected TIMEWHEEL_<SECTION>_<KEY> with "
                              f"SECTION one of {', '.join(s.upper() for s in _SECTIONS)}")
        raw[section][key] = value
    for section, values in (overrides or {}).items():
        raw.setdefault(section, {}).update({k: v for k, v in values.items() if v is not None})
    built: dict[str, Any] = {}
    for section, cls in _SECTIONS.items():
        hints = typing.get_type_hints(cls)
        known = {f.name for f in dataclasses.fields(cls)}
        removed: Mapping[str, str] = getattr(cls, "REMOVED_KEYS", {})
        for key in raw[section]:
            if key in removed:
                raise ConfigError(f"config key {section}.{key} was removed: {removed[key]}")
            if key not in known:
                raise ConfigError(f"unknown config key {section}.{key}; known: {', '.join(sorted(known))}")
        kwargs = {k: _coerce(section, k, v, hints[k]) for k, v in raw[section].items()}
        if section == "rocketmq" and "tls_verify" in kwargs and not kwargs.get("tls"):
            raise ConfigError(f"rocketmq.tls_verify = {kwargs['tls_verify']!r} is invalid: it must be unset unless "
                              f"tls = true (it is about TLS certificates)")
        if section == "engine" and "data_dir" not in kwargs:
            raise ConfigError("engine.data_dir is required (config file, TIMEWHEEL_ENGINE_DATA_DIR or --data-dir)")
        built[section] = cls(**kwargs)
    from forwarder.shaping_rules import parse_rules  # the rules are refused here, not as a traceback at serve

    parse_rules(raw["shaping"])
    return Settings(shaping=raw["shaping"], **built)
