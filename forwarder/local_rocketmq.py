"""A real Apache RocketMQ 5 NameServer and Broker on loopback, for tests, the demo and benchmarks.

The jars come from Maven Central, resolved once by `mvn dependency:copy-dependencies` into a cache
directory (`$TIMEWHEEL_CACHE_DIR` or `~/.cache/timewheel`, then `rocketmq-<version>/lib`). Each
`LocalRocketMQ` runs both JVMs with a run directory of its own (configs, store, logs, JVM output),
on free loopback ports, and can stop and restart the broker alone on the same ports and store.

Topics are created over RocketMQ's remoting protocol (one UPDATE_AND_CREATE_TOPIC_LIST request to
the broker for any number of topics, ~20 ms) rather than with `mqadmin updateTopic`, which costs a
JVM start (~4.5 s) per topic.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from forwarder.errors import LocalRocketMQError

__all__ = [
    "ROCKETMQ_VERSION",
    "LocalRocketMQ",
    "default_cache_dir",
    "ensure_distribution",
    "run_foreground",
    "topic_route",
]

#: The Apache RocketMQ release every local broker runs (its jars are cached per version).
ROCKETMQ_VERSION = "5.3.3"

_CACHE_ENV = "TIMEWHEEL_CACHE_DIR"
# Pinned so that the resolution does not depend on whatever plugin version Maven defaults to.
_DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.6.1"
_DOWNLOAD_TIMEOUT_S = 1800.0

# Ports are drawn below Linux's default ephemeral range (32768-60999), so that the client
# connections of a long test session cannot take a port the broker needs again on restart.
_PORT_RANGE = (20000, 32000)

_NAMESRV_READY = re.compile(rb"The Name Server boot success")
_BROKER_READY = re.compile(rb"The broker\[[^\]]*\] boot success")
_ADDRESS_IN_USE = re.compile(rb"Address already in use|BindException")

_POM = """<?xml version="1.0" encoding="UTF-8"?>
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>timewheel.local</groupId>
  <artifactId>rocketmq-distribution</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency>
      <groupId>org.apache.rocketmq</groupId>
      <artifactId>rocketmq-broker</artifactId>
      <version>{version}</version>
    </dependency>
    <dependency>
      <groupId>org.apache.rocketmq</groupId>
      <artifactId>rocketmq-namesrv</artifactId>
      <version>{version}</version>
    </dependency>
  </dependencies>
</project>
"""

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
    # The bundled logback warns about its own config at every start; keep the .out files short.
    "-Dlogback.statusListenerClass=org.apache.rocketmq.logging.ch.qos.logback.core.status.NopStatusListener",
)
_NAMESRV_JVM = ("-Xms64m", "-Xmx256m", "-Drmq.logback.configurationFile=rmq.namesrv.logback.xml")
_BROKER_JVM = (
    "-Xms256m",
    "-Xmx512m",
    "-XX:MaxDirectMemorySize=256m",
    "-Drmq.logback.configurationFile=rmq.broker.logback.xml",
)

# Remoting protocol: request codes and the one response code we accept.
_UPDATE_AND_CREATE_TOPIC_LIST = 18
_GET_ROUTEINFO_BY_TOPIC = 105
_GET_BROKER_CLUSTER_INFO = 106
_GET_CONSUMER_LIST_BY_GROUP = 38
_SUCCESS = 0
# The version a request claims (5.3.3's own): older claims get answers in non-standard JSON.
_REMOTING_VERSION = 479


def default_cache_dir() -> Path:
    """Return the cache root: `$TIMEWHEEL_CACHE_DIR`, else `~/.cache/timewheel`."""
    env = os.environ.get(_CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "timewheel"


def ensure_distribution(
    cache_dir: Path | None = None, version: str = ROCKETMQ_VERSION, timeout: float = _DOWNLOAD_TIMEOUT_S
) -> Path:
    """Return the `lib/` folder of RocketMQ `version`, downloading it with Maven the first time."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    home = root / f"rocketmq-{version}"
    lib = home / "lib"
    if _is_complete(lib, version):
        return lib
    mvn = shutil.which("mvn")
    if mvn is None:
        raise LocalRocketMQError(
            f"mvn (Apache Maven) is not on PATH: install it (e.g. `apt-get install maven`) so the "
            f"RocketMQ {version} jars can be fetched once into {lib}"
        )
    home.mkdir(parents=True, exist_ok=True)
    # Resolve into a fresh folder and rename it into place only when complete: a killed or failed
    # download never leaves a half cache, and two concurrent downloads cannot mix their jars.
    staging = Path(tempfile.mkdtemp(prefix=".download-", dir=home))
    log = home / "download.log"
    try:
        (staging / "pom.xml").write_text(_POM.format(version=version), encoding="utf-8")
        cmd = [
            mvn,
            "-B",
            "-f",
            str(staging / "pom.xml"),
            f"{_DEPENDENCY_PLUGIN}:copy-dependencies",
            "-DincludeScope=runtime",
            f"-DoutputDirectory={staging / 'lib'}",
        ]
        try:
            with log.open("wb") as out:
                proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, check=False)
        except subprocess.TimeoutExpired as e:
            raise LocalRocketMQError(
                f"downloading the RocketMQ {version} jars took over {timeout:.0f} s: check access to "
                f"Maven Central (log: {log})"
            ) from e
        if proc.returncode != 0 or not _is_complete(staging / "lib", version):
            raise LocalRocketMQError(
                f"downloading the RocketMQ {version} jars with mvn failed ({_last_error_line(log)}): "
                f"check access to Maven Central, then retry (log: {log})"
            )
        try:
            os.rename(staging / "lib", lib)
        except OSError:
            # Another process completed the same download first; its copy is as good as ours.
            if not _is_complete(lib, version):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return lib


def _is_complete(lib: Path, version: str) -> bool:
    """Tell whether `lib` holds a finished resolution (the rename is the last step of one)."""
    return (lib / f"rocketmq-broker-{version}.jar").is_file() and (lib / f"rocketmq-namesrv-{version}.jar").is_file()


def _last_error_line(log: Path) -> str:
    """Return the most telling line of a Maven log: its first [ERROR] line, or its last line."""
    try:
        lines = log.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return "no log"
    errors = [ln.strip() for ln in lines if ln.startswith("[ERROR]") and ln.strip() != "[ERROR]"]
    if errors:
        return errors[0][:300]
    return lines[-1].strip()[:300] if lines else "no output"


def _find_java() -> str:
    """Return the java executable ($JAVA_HOME first, then PATH), checking it is Java 11 or newer."""
    java_home = os.environ.get("JAVA_HOME")
    candidate = Path(java_home) / "bin" / "java" if java_home else None
    java = str(candidate) if candidate is not None and candidate.is_file() else shutil.which("java")
    if java is None:
        raise LocalRocketMQError(
            "java is not on PATH: install a Java 17 runtime (e.g. `apt-get install openjdk-17-jre-headless`) "
            "to run the local RocketMQ"
        )
    major = _java_major(java)
    if major is not None and major < 11:
        raise LocalRocketMQError(f"{java} is Java {major}; the local RocketMQ needs Java 11 or newer (17 preferred)")
    return java


_JAVA_MAJORS: dict[str, int | None] = {}


def _java_major(java: str) -> int | None:
    """Return the major version of `java` (None when it cannot be told), cached per executable."""
    if java not in _JAVA_MAJORS:
        try:
            out = subprocess.run([java, "-version"], capture_output=True, timeout=30, check=False).stderr
        except (OSError, subprocess.TimeoutExpired) as e:
            raise LocalRocketMQError(f"cannot run {java} -version ({e}): fix the Java installation") from e
        m = re.search(rb'version "(\d+)(?:\.(\d+))?', out)
        major = None if m is None else int(m.group(1))
        if major == 1 and m is not None and m.group(2):  # "1.8.0_x" is Java 8
            major = int(m.group(2))
        _JAVA_MAJORS[java] = major
    return _JAVA_MAJORS[java]


# ---------------------------------------------------------------------------------------------
# Process launching

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


def _terminate(procs: Iterable[subprocess.Popen[bytes]], timeout: float) -> None:
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


def _pick_ports(rng: random.Random) -> tuple[int, int, int]:
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


# ---------------------------------------------------------------------------------------------
# Remoting protocol (just enough to create topics and read routes)


def _remoting_call(
    addr: str, code: int, ext: Mapping[str, str], body: bytes, timeout: float
) -> tuple[dict[str, Any], bytes]:
    """Send one request command to `addr` and return (response header, response body)."""
    header = json.dumps(
        {
            "code": code,
            "language": "PYTHON",
            "version": _REMOTING_VERSION,
            "opaque": 1,
            "flag": 0,
            "extFields": dict(ext),
        }
    ).encode()
    # Frame: total length (after this field) | serialize type (0 = JSON) << 24 | header length
    # | header | body.
    frame = struct.pack(">ii", 4 + len(header) + len(body), len(header)) + header + body
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout) as sock:
        sock.sendall(frame)
        (length,) = struct.unpack(">i", _recv_exact(sock, 4))
        data = _recv_exact(sock, length)
    header_len = struct.unpack(">i", data[:4])[0] & 0xFFFFFF
    return json.loads(data[4 : 4 + header_len]), data[4 + header_len :]


def topic_route(namesrv_addr: str, topic: str, timeout: float = 5.0) -> dict[str, Any] | None:
    """Return the NameServer's route of `topic` (brokerDatas, queueDatas), or None if it has none."""
    try:
        header, body = _remoting_call(namesrv_addr, _GET_ROUTEINFO_BY_TOPIC, {"topic": topic}, b"", timeout)
    except OSError as e:
        raise LocalRocketMQError(f"cannot reach the NameServer at {namesrv_addr}: {e}") from e
    if header.get("code") != _SUCCESS:
        return None
    route: dict[str, Any] = json.loads(body)
    return route


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    """Read exactly `n` bytes from `sock`."""
    chunks = bytearray()
    while len(chunks) < n:
        chunk = sock.recv(n - len(chunks))
        if not chunk:
            raise ConnectionError("connection closed mid-response")
        chunks += chunk
    return bytes(chunks)


# ---------------------------------------------------------------------------------------------


def _tail(path: Path, lines: int = 25) -> str:
    """Return the last `lines` lines of a text file (empty if absent)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class LocalRocketMQ:
    """A NameServer and a Broker of Apache RocketMQ 5 running locally on loopback ports."""

    def __init__(
        self,
        run_dir: Path | None = None,
        *,
        cache_dir: Path | None = None,
        version: str = ROCKETMQ_VERSION,
        broker_options: Mapping[str, str | int | bool] | None = None,
        stop_timeout: float = 30.0,
    ) -> None:
        """Prepare (not start) a local RocketMQ; `run_dir` None means a temporary directory.

        `broker_options` add to or override the broker config; `stop_timeout` is the default
        grace period of stop() and stop_broker() before SIGKILL (a graceful broker stop takes
        10-15 s of shutdown hooks).
        """
        self._given_run_dir = Path(run_dir) if run_dir is not None else None
        self._cache_dir = cache_dir
        self._version = version
        self._broker_options = dict(broker_options or {})
        self._stop_timeout = stop_timeout
        self._run_dir: Path | None = None
        self._lib: Path | None = None
        self._java: str | None = None
        self._namesrv: subprocess.Popen[bytes] | None = None
        self._broker: subprocess.Popen[bytes] | None = None
        self._namesrv_port = 0
        self._broker_port = 0
        self._ha_port = 0
        self._lock = threading.RLock()

    # -- properties ---------------------------------------------------------------------------

    @property
    def namesrv_addr(self) -> str:
        """The NameServer address clients need, "127.0.0.1:PORT"."""
        self._require_started()
        return f"127.0.0.1:{self._namesrv_port}"

    @property
    def broker_addr(self) -> str:
        """The broker's remoting address, "127.0.0.1:PORT"."""
        self._require_started()
        return f"127.0.0.1:{self._broker_port}"

    @property
    def run_dir(self) -> Path:
        """The directory holding configs, the store, logs and the JVMs' output."""
        if self._run_dir is None:
            raise LocalRocketMQError("the local RocketMQ has not been started: call start() first")
        return self._run_dir

    @property
    def broker_pid(self) -> int | None:
        """The broker's process id while it runs (benchmarks sample its CPU time), else None."""
        return self._broker.pid if self.broker_running and self._broker is not None else None

    @property
    def broker_running(self) -> bool:
        """True while the broker process is alive."""
        return self._broker is not None and self._broker.poll() is None

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self, timeout: float = 120.0) -> None:
        """Download the jars if needed, start NameServer and Broker, and wait until both are up."""
        with self._lock:
            if self._namesrv is not None:
                raise LocalRocketMQError("the local RocketMQ is already started")
            self._java = _find_java()
            self._lib = ensure_distribution(self._cache_dir, self._version)
            if self._given_run_dir is not None:
                self._given_run_dir.mkdir(parents=True, exist_ok=True)
                self._run_dir = self._given_run_dir.resolve()
            else:
                self._run_dir = Path(tempfile.mkdtemp(prefix="timewheel-rocketmq-"))
            deadline = time.monotonic() + timeout
            rng = random.Random()
            try:
                # Another process may take a port between our check and the JVM's bind: retry
                # with fresh ports in that case only.
                for attempt in range(3):
                    self._namesrv_port, self._broker_port, self._ha_port = _pick_ports(rng)
                    self._write_configs()
                    try:
                        self._namesrv = self._start_jvm(
                            "namesrv", _NAMESRV_READY, deadline, "org.apache.rocketmq.namesrv.NamesrvStartup",
                            _NAMESRV_JVM, ["-c", str(self._run_dir / "namesrv.conf")],
                        )
                        self._broker = self._start_jvm(
                            "broker", _BROKER_READY, deadline, "org.apache.rocketmq.broker.BrokerStartup",
                            _BROKER_JVM, ["-c", str(self._run_dir / "broker.conf"), "-n", self.namesrv_addr],
                        )
                        self._wait_registered(deadline)
                        return
                    except _PortTaken:
                        _terminate([p for p in (self._namesrv, self._broker) if p is not None], 10.0)
                        self._namesrv = self._broker = None
                        if attempt == 2:
                            raise LocalRocketMQError(
                                f"the local RocketMQ could not bind its ports three times: see {self._run_dir}"
                            ) from None
            except BaseException:
                self._cleanup(10.0)
                raise

    def stop(self, timeout: float | None = None) -> None:
        """Stop Broker and NameServer (SIGTERM, SIGKILL after `timeout`); idempotent."""
        with self._lock:
            self._cleanup(self._stop_timeout if timeout is None else timeout)

    def stop_broker(self, timeout: float | None = None, *, kill: bool = False) -> None:
        """Stop the broker only (SIGTERM then SIGKILL, or SIGKILL at once with `kill`), keeping ports and store."""
        with self._lock:
            self._require_started()
            broker, self._broker = self._broker, None
            if broker is None or broker.poll() is not None:
                return
            if kill:
                # A crash, as a power cut or OOM killer would do it; the broker recovers its store
                # on the next start.
                broker.kill()
                broker.wait()
            else:
                _terminate([broker], self._stop_timeout if timeout is None else timeout)
            # The NameServer drops the broker when its connection closes; wait for that, so that
            # start_broker() can tell the new registration from the old one.
            deadline = time.monotonic() + 10.0
            while self._broker_registered() and time.monotonic() < deadline:
                time.sleep(0.05)

    def start_broker(self, timeout: float = 120.0) -> None:
        """Start the broker again on the same ports and store, after stop_broker()."""
        with self._lock:
            self._require_started()
            if self.broker_running:
                raise LocalRocketMQError("the broker is already running")
            deadline = time.monotonic() + timeout
            try:
                self._broker = self._start_jvm(
                    "broker", _BROKER_READY, deadline, "org.apache.rocketmq.broker.BrokerStartup",
                    _BROKER_JVM, ["-c", str(self.run_dir / "broker.conf"), "-n", self.namesrv_addr],
                )
            except _PortTaken as e:
                raise LocalRocketMQError(
                    f"the broker could not bind its old ports {self._broker_port - 2}, {self._broker_port}, "
                    f"{self._ha_port} again: another process took one (see {self.run_dir / 'broker.out'})"
                ) from e
            self._wait_registered(deadline)

    def __enter__(self) -> LocalRocketMQ:
        """Start and return self."""
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Stop both processes."""
        self.stop()

    # -- topics -------------------------------------------------------------------------------

    def create_topics(self, names: Iterable[str], queues: int = 4, timeout: float = 15.0) -> None:
        """Create (or update) topics with `queues` read/write queues and wait until routable."""
        topics = list(dict.fromkeys(names))
        if not topics:
            return
        self._require_started()
        body = json.dumps(
            {
                "topicConfigList": [
                    {
                        "topicName": t,
                        "readQueueNums": queues,
                        "writeQueueNums": queues,
                        "perm": 6,  # read and write
                        "topicFilterType": "SINGLE_TAG",
                        "topicSysFlag": 0,
                        "order": False,
                        "attributes": {},
                    }
                    for t in topics
                ]
            }
        ).encode()
        try:
            header, _ = _remoting_call(self.broker_addr, _UPDATE_AND_CREATE_TOPIC_LIST, {}, body, timeout)
        except OSError as e:
            raise LocalRocketMQError(f"cannot reach the broker at {self.broker_addr} to create topics: {e}") from e
        if header.get("code") != _SUCCESS:
            raise LocalRocketMQError(
                f"the broker refused to create topics {topics}: code {header.get('code')}, {header.get('remark')}"
            )
        # The broker registers new topics with the NameServer itself; wait until every route is
        # visible, since a client that looks a topic up too early caches "no route" for a while.
        deadline = time.monotonic() + timeout
        for topic in topics:
            while topic_route(self.namesrv_addr, topic, timeout) is None:
                if time.monotonic() > deadline:
                    raise LocalRocketMQError(f"topic {topic} has no route on the NameServer after {timeout} s")
                time.sleep(0.05)

    def consumer_ids(self, group: str, timeout: float = 5.0) -> list[str]:
        """Client ids of the members of consumer group `group` the broker knows now ([] if none)."""
        self._require_started()
        try:
            header, body = _remoting_call(self.broker_addr, _GET_CONSUMER_LIST_BY_GROUP, {"consumerGroup": group},
                                          b"", timeout)
        except OSError as e:
            raise LocalRocketMQError(f"cannot reach the broker at {self.broker_addr}: {e}") from e
        if header.get("code") != _SUCCESS:
            return []  # the broker answers "not online" for a group without members
        ids: list[str] = json.loads(body).get("consumerIdList", [])
        return sorted(ids)

    # -- internals ----------------------------------------------------------------------------

    def _require_started(self) -> None:
        """Raise unless start() succeeded."""
        if self._namesrv is None or self._run_dir is None:
            raise LocalRocketMQError("the local RocketMQ has not been started: call start() first")

    def _broker_registered(self) -> bool:
        """Tell whether the NameServer lists our broker (its answer is not strict JSON: match bytes)."""
        try:
            header, body = _remoting_call(self.namesrv_addr, _GET_BROKER_CLUSTER_INFO, {}, b"", 5.0)
        except OSError:
            return False
        return header.get("code") == _SUCCESS and f'"{self.broker_addr}"'.encode() in body

    def _wait_registered(self, deadline: float) -> None:
        """Wait until the NameServer routes to the broker.

        "boot success" is printed once the broker's own start returns, but its first registration
        with the NameServer runs on another thread and, on a busy machine, can come seconds later;
        until then clients find no route.
        """
        while not self._broker_registered():
            if self._broker is None or self._broker.poll() is not None or time.monotonic() > deadline:
                raise LocalRocketMQError(
                    f"the local RocketMQ broker started but did not register with the NameServer; "
                    f"log tail of {self.run_dir / 'logs' / 'rocketmqlogs' / 'broker.log'}:\n"
                    f"{_tail(self.run_dir / 'logs' / 'rocketmqlogs' / 'broker.log', 15)}"
                )
            time.sleep(0.05)

    def _write_configs(self) -> None:
        """Write namesrv.conf and broker.conf for the current ports into the run directory."""
        run = self.run_dir
        (run / "namesrv.conf").write_text(f"listenPort={self._namesrv_port}\nbindAddress=127.0.0.1\n")
        options: dict[str, str | int | bool] = {
            "brokerClusterName": "DefaultCluster",
            "brokerName": "broker-a",
            "brokerId": 0,
            "brokerIP1": "127.0.0.1",
            "brokerIP2": "127.0.0.1",
            "bindAddress": "127.0.0.1",
            "listenPort": self._broker_port,
            "haListenPort": self._ha_port,
            "storePathRootDir": str(run / "store"),
            "storePathCommitLog": str(run / "store" / "commitlog"),
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
        }
        options.update(self._broker_options)
        # Values are written bare: the broker silently ignores a number with trailing spaces.
        text = "".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}\n" for k, v in options.items())
        (run / "broker.conf").write_text(text)

    def _start_jvm(
        self,
        name: str,
        ready: re.Pattern[bytes],
        deadline: float,
        main_class: str,
        jvm_opts: tuple[str, ...],
        args: list[str],
    ) -> subprocess.Popen[bytes]:
        """Start one JVM and wait until its output shows `ready`; raise with its log tail if not."""
        run = self.run_dir
        assert self._java is not None and self._lib is not None
        out = run / f"{name}.out"
        offset = out.stat().st_size if out.exists() else 0
        env = dict(os.environ)
        env["ROCKETMQ_HOME"] = str(run)
        cmd = [
            self._java,
            *_JVM_COMMON,
            *jvm_opts,
            f"-Duser.home={run}",
            f"-Drocketmq.home.dir={run}",
            "-cp",
            f"{self._lib}{os.sep}*",
            main_class,
            *args,
        ]
        proc = _launch(cmd, env, out, run)
        while True:
            text = self._read_from(out, offset)
            if ready.search(text):
                return proc
            if proc.poll() is not None or time.monotonic() > deadline:
                timed_out = proc.poll() is None
                if timed_out:
                    proc.kill()
                    proc.wait()
                text = self._read_from(out, offset)
                if _ADDRESS_IN_USE.search(text):
                    raise _PortTaken(name)
                what = "did not come up in time" if timed_out else f"exited with code {proc.returncode}"
                raise LocalRocketMQError(
                    f"the local RocketMQ {name} {what}{self._hostname_hint()}; log tail of {out}:\n"
                    f"{_tail(out)}\n-- {run / 'logs' / 'rocketmqlogs' / (name + '.log')}:\n"
                    f"{_tail(run / 'logs' / 'rocketmqlogs' / (name + '.log'), 15)}"
                )
            time.sleep(0.05)

    @staticmethod
    def _read_from(path: Path, offset: int) -> bytes:
        """Return the content of `path` from byte `offset` (this start's output only)."""
        try:
            with path.open("rb") as f:
                f.seek(offset)
                return f.read()
        except OSError:
            return b""

    @staticmethod
    def _hostname_hint() -> str:
        """Explain the one start-up failure whose log says nothing useful: an unresolvable host name."""
        try:
            socket.gethostbyname(socket.gethostname())
        except OSError:
            return f" (host name {socket.gethostname()!r} does not resolve: map it to 127.0.0.1 in /etc/hosts)"
        return ""

    def _cleanup(self, timeout: float) -> None:
        """Stop whatever runs and remove a temporary run directory."""
        # Broker first so it can unregister from a NameServer that is still listening; both
        # shut down in parallel after that (the broker's graceful stop takes ~10 s).
        procs = [p for p in (self._broker, self._namesrv) if p is not None]
        self._broker = self._namesrv = None
        _terminate(procs, timeout)
        if self._given_run_dir is None and self._run_dir is not None:
            shutil.rmtree(self._run_dir, ignore_errors=True)
        self._run_dir = None if self._given_run_dir is None else self._run_dir


class _PortTaken(Exception):
    """Internal: a JVM could not bind a port that was free when we picked it."""


def run_foreground(dir: Path | None = None) -> None:
    """Run a local RocketMQ until SIGINT/SIGTERM, printing `namesrv 127.0.0.1:PORT` once ready."""
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    # A temporary store is deleted on exit, so Ctrl-C need not wait for the broker's graceful
    # shutdown (10-20 s); a kept store gets it, so that the next run starts without recovery.
    mq = LocalRocketMQ(run_dir=dir, stop_timeout=30.0 if dir is not None else 3.0)
    try:
        mq.start()
        print(f"namesrv {mq.namesrv_addr}", flush=True)
        while not stop.wait(0.5):
            if not mq.broker_running:
                raise LocalRocketMQError(
                    f"the local RocketMQ broker exited unexpectedly: see {mq.run_dir / 'broker.out'}"
                )
    finally:
        mq.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
