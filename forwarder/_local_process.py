"""Processes of a local RocketMQ: free ports, config files, JVMs started and stopped.

The NameServer and the Broker each run in a JVM of their own, started from the cached jars with a
run directory (configs, store, logs, JVM output), and are ready when their output says so.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from forwarder.errors import LocalRocketMQError

__all__ = ["BROKER_JVM", "BROKER_READY", "MQADMIN_JVM", "NAMESRV_JVM", "NAMESRV_READY", "PortTaken", "major_version",
           "pick_ports", "quiet_logback", "start_jvm", "tail", "terminate", "write_broker_config", "write_configs",
           "write_legacy_logback"]

# Ports are drawn below Linux's default ephemeral range (32768-60999), so that the client
# connections of a long test session cannot take a port the broker needs again on restart.
_PORT_RANGE = (20000, 32000)

NAMESRV_READY = re.compile(rb"The Name Server boot success")
BROKER_READY = re.compile(rb"The broker\[[^\]]*\] boot success")
_ADDRESS_IN_USE = re.compile(rb"Address already in use|BindException")

# JVM flags both processes share. The two --add-* flags are what the RocketMQ start scripts pass
# on Java 9+; -XX:-UsePerfData keeps hsperfdata files out of /tmp.
_JVM_COMMON = (
    "-server",
    "-XX:-UsePerfData",
    "--add-exports",
    "java.base/sun.nio.ch=ALL-UNNAMED",
    "--add-opens",
    "java.base/java.lang=ALL-UNNAMED",
    "-Djava.net.preferIPv4Stack=true",
    "-Dtls.server.mode=disabled",
)
# RocketMQ 5 bundles a shaded logback that warns about its own config at every start: keep the .out
# files short. RocketMQ 4 uses plain logback, configured from $ROCKETMQ_HOME/conf (`write_legacy_logback`).
_QUIET_LOGBACK = {
    5: "-Dlogback.statusListenerClass=org.apache.rocketmq.logging.ch.qos.logback.core.status.NopStatusListener",
    4: "-Dlogback.statusListenerClass=ch.qos.logback.core.status.NopStatusListener",
}
_LEGACY_LOGBACK = """<?xml version="1.0" encoding="UTF-8"?>
<configuration>
  <appender name="FILE" class="ch.qos.logback.core.FileAppender">
    <file>${{user.home}}/logs/rocketmqlogs/{name}.log</file>
    <encoder><pattern>%d{{yyyy-MM-dd HH:mm:ss}} %p %t - %m%n</pattern></encoder>
  </appender>
  <root level="INFO"><appender-ref ref="FILE"/></root>
</configuration>
"""


def quiet_logback(major: int) -> str:
    """The JVM flag that keeps RocketMQ `major`'s logback from printing its own status at start."""
    return _QUIET_LOGBACK[min(max(major, 4), 5)]


def major_version(version: str) -> int:
    """The major version of a RocketMQ release ("4.9.7" -> 4)."""
    head = version.split(".", 1)[0]
    if not head.isdigit():
        raise LocalRocketMQError(f"RocketMQ version {version!r} is not of the form MAJOR.MINOR.PATCH")
    return int(head)


def write_legacy_logback(home: Path) -> None:
    """The logback files a RocketMQ 4 NameServer, broker and mqadmin read from `home`/conf (the servers exit
    without them)."""
    (home / "conf").mkdir(parents=True, exist_ok=True)
    for name in ("namesrv", "broker", "tools"):
        (home / "conf" / f"logback_{name}.xml").write_text(_LEGACY_LOGBACK.format(name=name))
NAMESRV_JVM = ("-Xms64m", "-Xmx256m", "-Drmq.logback.configurationFile=rmq.namesrv.logback.xml")
BROKER_JVM = (
    "-Xms256m",
    "-Xmx512m",
    "-XX:MaxDirectMemorySize=256m",
    "-Drmq.logback.configurationFile=rmq.broker.logback.xml",
)

# RocketMQ's admin tool, as its `mqadmin` script starts it (a small client JVM).
MQADMIN_JVM = ("-Xms64m", "-Xmx256m", "-XX:-UsePerfData", "-Djava.net.preferIPv4Stack=true",
               "-Drocketmq.client.logLevel=ERROR")


class PortTaken(Exception):
    """A JVM could not bind a port that was free when we picked it (pick others and start again)."""


_PDEATHSIG = shutil.which("setpriv")
# The JVMs are forked from this one long-lived thread: with `setpriv --pdeathsig` a child gets
# SIGTERM when the thread that forked it ends, so forking from a caller's short-lived thread
# would stop a broker early, while forking here stops the JVMs only when this process dies
# (even by SIGKILL), which keeps crashed test sessions from leaving brokers behind.
_LAUNCHER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rocketmq-launcher")


def _launch(cmd: list[str], env: dict[str, str], out_path: Path, cwd: Path) -> subprocess.Popen[bytes]:
    """Start `cmd` with stdout and stderr appended to `out_path`."""
    if _PDEATHSIG is not None:
        cmd = [_PDEATHSIG, "--pdeathsig", "TERM", "--", *cmd]

    def spawn() -> subprocess.Popen[bytes]:
        with out_path.open("ab") as out:
            return subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                # Own session: a Ctrl-C meant for the Python process must not reach the JVMs
                # before we stop them in order.
                start_new_session=True,
            )

    return _LAUNCHER.submit(spawn).result()


def terminate(procs: Iterable[subprocess.Popen[bytes]], timeout: float) -> None:
    """SIGTERM every live process, wait up to `timeout` for all, then SIGKILL the rest."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in live:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _port_free(port: int) -> bool:
    """Tell whether `port` can be bound on all interfaces (the broker's HA port binds there)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def pick_ports(rng: random.Random) -> tuple[int, int, int]:
    """Pick (namesrv, broker listen, broker HA) ports; listen-2 (the fast channel) is free too."""
    low, high = _PORT_RANGE
    for _ in range(500):
        namesrv = rng.randrange(low, high)
        listen = rng.randrange(low + 2, high - 1)
        ha = listen + 1
        broker_ports = {listen - 2, listen, ha}
        if namesrv in broker_ports or not all(_port_free(p) for p in (namesrv, *broker_ports)):
            continue
        return namesrv, listen, ha
    raise LocalRocketMQError(f"no free loopback ports in {low}-{high}: stop leftover brokers or free some ports")


def tail(path: Path, lines: int = 25) -> str:
    """Return the last `lines` lines of a text file (empty if absent)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def write_configs(run: Path, namesrv_port: int, broker_port: int, ha_port: int,
                  broker_options: Mapping[str, str | int | bool]) -> None:
    """Write namesrv.conf and (the first broker's) broker.conf for these ports into the run directory `run`."""
    (run / "namesrv.conf").write_text(f"listenPort={namesrv_port}\nbindAddress=127.0.0.1\n")
    write_broker_config(run, "broker-a", broker_port, ha_port, broker_options)


def write_broker_config(folder: Path, name: str, broker_port: int, ha_port: int,
                        broker_options: Mapping[str, str | int | bool]) -> None:
    """Write `folder`/broker.conf for broker `name` on these ports, its store under `folder`/store."""
    folder.mkdir(parents=True, exist_ok=True)
    options: dict[str, str | int | bool] = {
        "brokerClusterName": "DefaultCluster",
        "brokerName": name,
        "brokerId": 0,
        "brokerIP1": "127.0.0.1",
        "brokerIP2": "127.0.0.1",
        "bindAddress": "127.0.0.1",
        "listenPort": broker_port,
        "haListenPort": ha_port,
        "storePathRootDir": str(folder / "store"),
        "storePathCommitLog": str(folder / "store" / "commitlog"),
        # Small mapped files: the defaults (1 GB commit log, 6 MB consume queues) are sized
        # for production disks.
        "mappedFileSizeCommitLog": 67108864,
        "mappedFileSizeConsumeQueue": 60000,
        "maxHashSlotNum": 10000,
        "maxIndexNum": 40000,
        "autoCreateTopicEnable": True,
        "autoCreateSubscriptionGroup": True,
        "flushDiskType": "ASYNC_FLUSH",
        "enableDLegerCommitLog": False,
        "waitTimeMillsInSendQueue": 3000,
        "osPageCacheBusyTimeOutMills": 5000,
        # The broker's own timer is a benchmark peer: keep it on.
        "timerWheelEnable": True,
        # A developer's disk is often fuller than the 90 % at which the broker refuses writes
        # and the 85 % at which it deletes commit logs by force.
        "diskSpaceWarningLevelRatio": 98,
        "diskSpaceCleanForciblyRatio": 97,
        # Delivery looks messages up on their target by UNIQ_KEY through this index before a
        # re-send: it must exist (the default) and survive a kill -9, which by default it does not
        # (most recent entries vanish), so that "not in the index" means "not stored".
        "messageIndexEnable": True,
        "messageIndexSafe": True,
    }
    options.update(broker_options)
    # Values are written bare: the broker silently ignores a number with trailing spaces.
    text = "".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}\n" for k, v in options.items())
    (folder / "broker.conf").write_text(text)


def start_jvm(
    java: str,
    lib: Path,
    run: Path,
    name: str,
    ready: re.Pattern[bytes],
    deadline: float,
    main_class: str,
    jvm_opts: tuple[str, ...],
    args: list[str],
    major: int = 5,
) -> subprocess.Popen[bytes]:
    """Start one JVM (of RocketMQ `major`) and wait until its output shows `ready`; raise with its log tail if not."""
    out = run / f"{name}.out"
    offset = out.stat().st_size if out.exists() else 0
    env = dict(os.environ)
    env["ROCKETMQ_HOME"] = str(run)
    cmd = [
        java,
        *_JVM_COMMON,
        quiet_logback(major),
        *jvm_opts,
        f"-Duser.home={run}",
        f"-Drocketmq.home.dir={run}",
        "-cp",
        f"{lib}{os.sep}*",
        main_class,
        *args,
    ]
    proc = _launch(cmd, env, out, run)
    while True:
        text = _read_from(out, offset)
        if ready.search(text):
            return proc
        if proc.poll() is not None or time.monotonic() > deadline:
            timed_out = proc.poll() is None
            if timed_out:
                proc.kill()
                proc.wait()
            text = _read_from(out, offset)
            if _ADDRESS_IN_USE.search(text):
                raise PortTaken(name)
            what = "did not come up in time" if timed_out else f"exited with code {proc.returncode}"
            raise LocalRocketMQError(
                f"the local RocketMQ {name} {what}{_hostname_hint()}; log tail of {out}:\n"
                f"{tail(out)}\n-- {run / 'logs' / 'rocketmqlogs' / (name + '.log')}:\n"
                f"{tail(run / 'logs' / 'rocketmqlogs' / (name + '.log'), 15)}"
            )
        time.sleep(0.05)


def _read_from(path: Path, offset: int) -> bytes:
    """Return the content of `path` from byte `offset` (this start's output only)."""
    try:
        with path.open("rb") as f:
            f.seek(offset)
            return f.read()
    except OSError:
        return b""


def _hostname_hint() -> str:
    """Explain the one start-up failure whose log says nothing useful: an unresolvable host name."""
    try:
        socket.gethostbyname(socket.gethostname())
    except OSError:
        return f" (host name {socket.gethostname()!r} does not resolve: map it to 127.0.0.1 in /etc/hosts)"
    return ""
