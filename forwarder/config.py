"""Where the engine meets RocketMQ: the typed `[rocketmq]` configuration."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, Literal

from forwarder.contract import SYSTEM_TOPIC_PREFIXES, ContractViolation, check_target_topic
from forwarder.rocketmq import ClientSecurity, Credentials
from forwarder.rocketmq.connection import host_port_ok
from forwarder.rocketmq.security import CA_FILE_WANTED, ca_file_problem
from timewheel.errors import ConfigError

#: the default `dedupe_sentinel_topic` (the local launcher creates it on every broker)
SENTINEL_TOPIC = "TW_SENTINEL"


@dataclass(frozen=True)
class RocketMQConfig:
    """Where the engine meets RocketMQ; field names are the TOML keys of `[rocketmq]`."""

    namesrv: str = "127.0.0.1:9876"
    delay_topic: str = "TW_DELAY"
    dead_letter_topic: str = "TW_DLQ"
    consumer_group: str = "timewheel-ingest"
    producer_group: str = "timewheel-delivery"
    consume_batch: int = 32
    #: a delay-topic queue whose pull emptied it is pulled again on the next tick of this period, with
    #: the other queues of its broker: fewer, fuller pulls, one commit a tick under a steady stream (a
    #: message due sooner than this after it was sent may be stored, and so delivered, up to this
    #: late); a backlog is pulled without a pause
    consume_linger_ms: int = 20
    #: when the engine refused to store every batch holding a delay-topic queue's messages for this long
    #: (a disk that fails, a dead-letter topic refused), that broker's pull thread stops and the service
    #: reports not ready (`serve` exits 3 for its supervisor); nothing refused is committed
    consume_refused_max_s: float = 120.0
    send_threads: int = 4
    send_linger_ms: int = 0  # a small batch waits this long after it was due for more to join it
    #: under load the linger grows with the due rate (1 ms more per 1,000 a second with the defaults),
    #: up to this at 10,000 due a second
    send_linger_max_ms: int = 6
    send_timeout_ms: int = 3000
    breaker_failures: int = 20
    breaker_open_seconds: float = 5.0
    #: ACL user for a cluster with authentication on; the secret from `secret_key` (best set through
    #: TIMEWHEEL_ROCKETMQ_SECRET_KEY) or from the first line of `secret_key_file`
    access_key: str = ""
    secret_key: str = field(default="", repr=False)
    secret_key_file: str = ""
    tls: bool = False  # wrap every connection to NameServers and brokers in TLS
    #: the brokers' certificates are checked against tls_ca_file, else the system's CAs (always, unless
    #: tls_insecure: false alone is refused, so that no config turns checks off without saying so)
    tls_verify: bool = True
    tls_ca_file: str = ""
    #: check no certificate: only for a throw-away test broker on a self-signed certificate
    tls_insecure: bool = False
    #: RocketMQ message trace of the engine's two hops (consumed from the delay topic, produced to the
    #: target), written to `trace_topic` as RocketMQ's clients write theirs (`forwarder.trace`)
    trace: bool = False
    trace_topic: str = "RMQ_SYS_TRACE_TOPIC"
    #: zero duplicates: after a restart, a takeover or an ambiguous failed send, look each message up on
    #: its target topic (the brokers' message index) and send again only what no broker holds
    #: (`forwarder.copy_finder`); needs messageIndexSafe=true on the brokers (see docs/HA.md)
    dedupe: bool = True
    #: how long after a restart or takeover before the look-up (a dead predecessor's last writes land)
    dedupe_quiet_ms: int = 2000
    #: a topic with a queue on every broker of the targets: a message sent there and found in a
    #: broker's index proves that every message that broker stored before it is indexed
    dedupe_sentinel_topic: str = SENTINEL_TOPIC
    #: how far apart the engine's clock and the brokers' may be: widens every look-up window
    dedupe_clock_skew_ms: int = 2000
    #: hold every send while this host's clock is measured ahead of a broker's by more than this
    #: (`forwarder.clock_check`: due times are made by the brokers' clocks, so a host far ahead would
    #: send early); measured with a message to `dedupe_sentinel_topic`; 0: off (nothing measured)
    max_clock_ahead_ms: int = 30_000
    #: fault injection for the fault harness, never for production: after this many send batches
    #: were written and answered, and before their outcomes are recorded, signal this very process
    #: (`fault_signal`); 0: never
    fault_after_sends: int = 0
    fault_signal: Literal["SIGKILL", "SIGSTOP"] = "SIGKILL"

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
        # loaded, not only looked for: a file that holds no certificate would fail every connection
        # later, as if the brokers were down
        ca_problem = ca_file_problem(self.tls_ca_file) if self.tls and self.tls_ca_file else None
        checks = [
            ("namesrv", _namesrv_ok(self.namesrv), "HOST:PORT, several ';'-separated, each with a host and a port "
                                                   "between 1 and 65535"),
            ("delay_topic", _topic_problem(self.delay_topic) is None,
             f"a topic name ({_topic_problem(self.delay_topic)})"),
            ("dead_letter_topic", _topic_problem(self.dead_letter_topic) is None,
             f"a topic name ({_topic_problem(self.dead_letter_topic)})"),
            ("consumer_group", bool(self.consumer_group), "a group name"),
            ("producer_group", bool(self.producer_group), "a group name"),
            ("consume_batch", 1 <= self.consume_batch <= 1024, "between 1 and 1024"),
            ("consume_linger_ms", 0 <= self.consume_linger_ms <= 1000, "between 0 and 1000"),
            ("consume_refused_max_s", 1 <= self.consume_refused_max_s <= 86_400, "between 1 and 86400 seconds"),
            ("send_threads", 1 <= self.send_threads <= 64, "between 1 and 64"),
            ("send_linger_ms", 0 <= self.send_linger_ms <= 1000, "between 0 and 1000"),
            ("send_linger_max_ms", self.send_linger_ms <= self.send_linger_max_ms <= 1000,
             "between send_linger_ms and 1000"),
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
            ("tls_ca_file", not self.tls_ca_file or self.tls, "unset unless tls = true (it checks TLS certificates)"),
            ("tls_insecure", not self.tls_insecure or self.tls, "false unless tls = true"),
            ("tls_insecure", not (self.tls_insecure and self.tls_ca_file),
             "false when tls_ca_file is set (a CA file is only for checking certificates)"),
            ("tls_verify", self.tls_verify or self.tls_insecure,
             "true: certificates are always checked; set tls_insecure = true to check none (a self-signed test "
             "broker; `timewheel broker --tls` prints its CA file instead)"),
            ("dedupe_quiet_ms", 0 <= self.dedupe_quiet_ms <= 600_000, "between 0 and 600000"),
            ("dedupe_clock_skew_ms", 0 <= self.dedupe_clock_skew_ms <= 600_000, "between 0 and 600000"),
            ("max_clock_ahead_ms", self.max_clock_ahead_ms == 0 or 1_000 <= self.max_clock_ahead_ms <= 86_400_000,
             "0 (off) or between 1000 and 86400000 (a day)"),
            ("dedupe_sentinel_topic", _topic_problem(self.dedupe_sentinel_topic) is None
             and self.dedupe_sentinel_topic not in (self.delay_topic, self.dead_letter_topic),
             "a topic name other than delay_topic and dead_letter_topic"),
            ("fault_after_sends", self.fault_after_sends >= 0, "0 (off) or a positive count"),
            ("fault_signal", self.fault_signal in ("SIGKILL", "SIGSTOP"), '"SIGKILL" or "SIGSTOP"'),
            ("tls_ca_file", ca_problem is None, f"{CA_FILE_WANTED} (it cannot be used: {ca_problem})"),
        ]
        for name, ok, want in checks:
            if not ok:
                shown = "<redacted>" if name in self.SECRET_KEYS else repr(getattr(self, name))
                raise ConfigError(f"rocketmq.{name} = {shown} is invalid: it must be {want}")
        if self.secret_key_file:  # read now: a file missing or empty is said before anything starts
            _read_secret_file(self.secret_key_file)

    def security(self) -> ClientSecurity | None:
        """What every connection to the cluster applies: ACL signing and/or TLS (None: neither)."""
        if not self.access_key and not self.tls:
            return None
        creds = None
        if self.access_key:
            # read again: the file may have changed, or gone, since the settings were loaded
            secret = _read_secret_file(self.secret_key_file) if self.secret_key_file else self.secret_key
            creds = Credentials(self.access_key, secret)
        return ClientSecurity(creds, self.tls, self.tls_insecure, self.tls_ca_file or None)


def _read_secret_file(path: str) -> str:
    """The ACL secret: the first line of the file at `path`, stripped; ConfigError naming the key and the file."""
    fix = "point it at a file whose first line is the secret key"
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ConfigError(f"rocketmq.secret_key_file = {path!r} cannot be read ({(e.strerror or str(e)).lower()}): "
                          f"{fix}") from e
    except UnicodeDecodeError as e:
        raise ConfigError(f"rocketmq.secret_key_file = {path!r} is not UTF-8 text (byte {e.start}): {fix}") from e
    if not lines or not lines[0].strip():
        raise ConfigError(f"rocketmq.secret_key_file = {path!r} holds no secret (its first line is empty): {fix}")
    return lines[0].strip()


def _namesrv_ok(namesrv: str) -> bool:
    """Whether `namesrv` is one or more ';'-separated HOST:PORT, each with a host and a valid port."""
    return all(host_port_ok(addr.strip()) for addr in namesrv.split(";"))


def _topic_problem(topic: str) -> str | None:
    """Why `topic` cannot be one of the engine's own topics (the same check as a delivery target's), or None."""
    if isinstance(topic, str) and topic.startswith(SYSTEM_TOPIC_PREFIXES):
        return "not a RocketMQ system topic"
    try:
        check_target_topic(topic)
    except ContractViolation:
        return "ASCII letters, digits, '_' and '-', at most 127"
    return None
