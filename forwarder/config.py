"""Where the engine meets RocketMQ: the typed `[rocketmq]` configuration."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from forwarder.rocketmq import ClientSecurity, Credentials
from timewheel.errors import ConfigError


@dataclass(frozen=True)
class RocketMQConfig:
    """Where the engine meets RocketMQ; field names are the TOML keys of `[rocketmq]`."""

    namesrv: str = "127.0.0.1:9876"
    delay_topic: str = "TW_DELAY"
    dead_letter_topic: str = "TW_DLQ"
    consumer_group: str = "timewheel-ingest"
    producer_group: str = "timewheel-delivery"
    consume_batch: int = 32
    send_threads: int = 4
    send_linger_ms: int = 2  # a small batch waits this long after it was due for more to join it
    send_timeout_ms: int = 3000
    breaker_failures: int = 20
    breaker_open_seconds: float = 5.0
    #: ACL user for a cluster with authentication on; the secret from `secret_key` (best set through
    #: TIMEWHEEL_ROCKETMQ_SECRET_KEY) or from the first line of `secret_key_file`
    access_key: str = ""
    secret_key: str = field(default="", repr=False)
    secret_key_file: str = ""
    tls: bool = False  # wrap every connection to NameServers and brokers in TLS
    tls_verify: bool = False  # check the brokers' certificates (against tls_ca_file, else the system's CAs)
    tls_ca_file: str = ""
    #: RocketMQ message trace of the engine's two hops (consumed from the delay topic, produced to the
    #: target), written to `trace_topic` as RocketMQ's clients write theirs (`forwarder.trace`)
    trace: bool = False
    trace_topic: str = "RMQ_SYS_TRACE_TOPIC"

    #: keys whose values are never shown (print-config, logs)
    SECRET_KEYS: ClassVar[frozenset[str]] = frozenset({"secret_key"})

    #: Keys earlier versions accepted, with what to do instead: a config setting one fails loudly.
    REMOVED_KEYS: ClassVar[Mapping[str, str]] = {
        "ingest_client": "ingest always pulls batches over the wire protocol (the push client was slower "
                         "and crashed on shutdown); delete the key",
        "consume_threads": "it configured the removed push client; delete the key (consume_batch sizes "
                           "the pulled batches)",
    }

    def __post_init__(self) -> None:
        host, _, port = self.namesrv.rpartition(":")
        checks = [
            ("namesrv", bool(host) and port.isdigit() and 0 < int(port) < 65536, "HOST:PORT (several: ';'-separated)"
             if ";" not in self.namesrv else "HOST:PORT"),
            ("delay_topic", bool(self.delay_topic), "a topic name"),
            ("dead_letter_topic", bool(self.dead_letter_topic), "a topic name"),
            ("consumer_group", bool(self.consumer_group), "a group name"),
            ("producer_group", bool(self.producer_group), "a group name"),
            ("consume_batch", 1 <= self.consume_batch <= 1024, "between 1 and 1024"),
            ("send_threads", 1 <= self.send_threads <= 64, "between 1 and 64"),
            ("send_linger_ms", 0 <= self.send_linger_ms <= 1000, "between 0 and 1000"),
            ("send_timeout_ms", self.send_timeout_ms > 0, "positive"),
            ("breaker_failures", self.breaker_failures >= 1, "at least 1"),
            ("breaker_open_seconds", self.breaker_open_seconds > 0, "positive"),
            ("trace_topic", bool(self.trace_topic) and self.trace_topic not in (self.delay_topic, self.dead_letter_topic),
             "a topic name other than delay_topic and dead_letter_topic"),
            ("dead_letter_topic", self.dead_letter_topic != self.delay_topic,
             "another topic than delay_topic (dead letters would be ingested again)"),
            ("secret_key", not (self.secret_key and self.secret_key_file), "unset when secret_key_file is set"),
            ("access_key", bool(self.access_key) == bool(self.secret_key or self.secret_key_file),
             "set together with secret_key or secret_key_file"),
        ]
        for name, ok, want in checks:
            if not ok and not (name == "namesrv" and ";" in self.namesrv):
                shown = "<redacted>" if name in self.SECRET_KEYS else repr(getattr(self, name))
                raise ConfigError(f"rocketmq.{name} = {shown} is invalid: it must be {want}")

    def security(self) -> ClientSecurity | None:
        """What every connection to the cluster applies: ACL signing and/or TLS (None: neither)."""
        if not self.access_key and not self.tls:
            return None
        creds = None
        if self.access_key:
            secret = self.secret_key
            if self.secret_key_file:
                try:
                    secret = Path(self.secret_key_file).read_text().splitlines()[0].strip()
                except (OSError, IndexError) as e:
                    raise ConfigError(f"rocketmq.secret_key_file = {self.secret_key_file!r} cannot be read: {e}; "
                                      f"point it at a file whose first line is the secret key") from e
            creds = Credentials(self.access_key, secret)
        return ClientSecurity(creds, self.tls, self.tls_verify, self.tls_ca_file or None)
