"""A real Apache RocketMQ 5 NameServer and Broker on loopback, for tests, the demo and benchmarks.

Each `LocalRocketMQ` runs both JVMs (`forwarder._local_process`) from the cached jars
(`forwarder._local_distribution`) with a run directory of its own (configs, store, logs, JVM
output), on free loopback ports, and can stop and restart the broker alone on the same ports and
store. Topics are created and registration is checked with the wire client's admin requests
(`forwarder.rocketmq.admin`): one request for any number of topics (~20 ms) rather than
`mqadmin updateTopic`, which costs a JVM start (~4.5 s) per topic.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType

from forwarder._local_distribution import ROCKETMQ_VERSION, default_cache_dir, ensure_distribution, find_java
from forwarder._local_process import (BROKER_JVM, BROKER_READY, MQADMIN_JVM, NAMESRV_JVM, NAMESRV_READY, PortTaken,
                                      major_version, pick_ports, quiet_logback, start_jvm, tail, terminate,
                                      write_broker_config, write_configs, write_legacy_logback)
from forwarder._local_tls import tls_jvm_flags
from forwarder.config import SENTINEL_TOPIC
from forwarder.errors import LocalRocketMQError
from forwarder.rocketmq import (ClientSecurity, Credentials, NameServerClient, RemotingError, broker_registered,
                                consumer_ids, consumer_lag, create_topics, topic_route)

__all__ = ["ROCKETMQ_VERSION", "LocalRocketMQ", "default_cache_dir", "ensure_distribution", "run_foreground",
           "topic_route"]


def acl_broker_options(user: Credentials) -> dict[str, str | int | bool]:
    """Broker settings of RocketMQ 5's authentication and authorization, with `user` as the
    administrator (created at first start) and as the credentials of the broker's own inner client."""
    provider = "org.apache.rocketmq.auth.{0}.provider.{1}"
    return {
        "authenticationEnabled": True,
        "authorizationEnabled": True,
        "authenticationProvider": provider.format("authentication", "DefaultAuthenticationProvider"),
        "authenticationMetadataProvider": provider.format("authentication", "LocalAuthenticationMetadataProvider"),
        "authorizationProvider": provider.format("authorization", "DefaultAuthorizationProvider"),
        "authorizationMetadataProvider": provider.format("authorization", "LocalAuthorizationMetadataProvider"),
        "initAuthenticationUser": json.dumps({"username": user.access_key, "password": user.secret_key}),
        "innerClientAuthenticationCredentials": json.dumps({"accessKey": user.access_key,
                                                            "secretKey": user.secret_key}),
    }


@dataclass
class _BrokerNode:
    """One broker of the local cluster: its name, ports, folder (config, store, logs, output) and process."""

    name: str
    folder: Path
    port: int = 0
    ha_port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class LocalRocketMQ:
    """A NameServer and one or more Brokers of Apache RocketMQ running locally on loopback ports."""

    def __init__(
        self,
        run_dir: Path | None = None,
        *,
        cache_dir: Path | None = None,
        version: str = ROCKETMQ_VERSION,
        broker_options: Mapping[str, str | int | bool] | None = None,
        stop_timeout: float = 30.0,
        acl: Credentials | None = None,
        tls: bool = False,
        brokers: int = 1,
    ) -> None:
        """Prepare (not start) a local RocketMQ; `run_dir` None means a temporary directory.

        `brokers` masters (broker-a, broker-b, ...) register with the one NameServer; the first one's
        files are in the run directory itself, each further one's in a sub-directory of its name.

        `broker_options` add to or override the broker config; `stop_timeout` is the default
        grace period of stop() and stop_broker() before SIGKILL (a graceful broker stop takes
        10-15 s of shutdown hooks). With `acl`, the broker authenticates and authorizes every
        request and that user is its administrator (and the broker's own inner client). With `tls`,
        NameServer and broker refuse plain connections (`tls.server.mode=enforcing`) and serve a
        self-signed certificate made in the run directory; `security` then wraps clients in TLS.
        """
        self.acl = acl
        self.tls = tls
        #: what clients of this cluster apply (with `tls`, the certificate made at start is the CA)
        self.security: ClientSecurity | None = ClientSecurity(acl) if acl is not None else None
        self._given_run_dir = Path(run_dir) if run_dir is not None else None
        self._cache_dir = cache_dir
        self._version = version
        self._major = major_version(version)
        self._broker_options = {**(acl_broker_options(acl) if acl is not None else {}), **(broker_options or {})}
        self._stop_timeout = stop_timeout
        self._run_dir: Path | None = None
        self._lib: Path | None = None
        self._java: str | None = None
        if not 1 <= brokers <= 26:
            raise LocalRocketMQError(f"brokers = {brokers}: a local cluster has 1 to 26 brokers")
        self._broker_count = brokers
        self._namesrv: subprocess.Popen[bytes] | None = None
        self._nodes: list[_BrokerNode] = []
        self._namesrv_port = 0
        self._lock = threading.RLock()

    # -- properties ---------------------------------------------------------------------------

    @property
    def namesrv_addr(self) -> str:
        """The NameServer address clients need, "127.0.0.1:PORT"."""
        self._require_started()
        return f"127.0.0.1:{self._namesrv_port}"

    @property
    def broker_addr(self) -> str:
        """The (first) broker's remoting address, "127.0.0.1:PORT"."""
        self._require_started()
        return self._nodes[0].addr

    @property
    def broker_addrs(self) -> dict[str, str]:
        """Every broker's name and remoting address."""
        self._require_started()
        return {n.name: n.addr for n in self._nodes}

    @property
    def version(self) -> str:
        """The RocketMQ release this cluster runs."""
        return self._version

    @property
    def run_dir(self) -> Path:
        """The directory holding configs, the store, logs and the JVMs' output."""
        if self._run_dir is None:
            raise LocalRocketMQError("the local RocketMQ has not been started: call start() first")
        return self._run_dir

    @property
    def tls_ca_file(self) -> Path:
        """The self-signed certificate a TLS cluster serves (made at start): the CA its clients trust."""
        return self.run_dir / "tls" / "cert.pem"

    @property
    def broker_pid(self) -> int | None:
        """The (first) broker's process id while it runs (benchmarks sample its CPU time), else None."""
        proc = self._nodes[0].proc if self._nodes else None
        return proc.pid if proc is not None and self.broker_running else None

    @property
    def broker_running(self) -> bool:
        """True while the (first) broker process is alive."""
        return bool(self._nodes) and self._nodes[0].running

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self, timeout: float = 120.0) -> None:
        """Download the jars if needed, start NameServer and Broker, and wait until both are up."""
        with self._lock:
            if self._namesrv is not None:
                raise LocalRocketMQError("the local RocketMQ is already started")
            if self._given_run_dir is not None:  # refused before java (a JVM) is looked for and jars fetched
                self._run_dir = _make_run_dir(self._given_run_dir)
            self._java = find_java()
            self._lib = ensure_distribution(self._cache_dir, self._version)
            if self._given_run_dir is None:
                self._run_dir = Path(tempfile.mkdtemp(prefix="timewheel-rocketmq-"))
            deadline = time.monotonic() + timeout
            rng = random.Random()
            try:
                # Another process may take a port between our check and the JVM's bind: retry
                # with fresh ports in that case only.
                for attempt in range(3):
                    self._namesrv_port, port, ha = pick_ports(rng)
                    write_configs(self.run_dir, self._namesrv_port, port, ha, self._broker_options)
                    self._nodes = [_BrokerNode("broker-a", self.run_dir, port, ha)]
                    taken = {self._namesrv_port, port - 2, port, ha}
                    for i in range(1, self._broker_count):
                        _, port, ha = pick_ports(rng)
                        while {port - 2, port, ha} & taken:
                            _, port, ha = pick_ports(rng)
                        taken |= {port - 2, port, ha}
                        name = f"broker-{chr(ord('a') + i)}"
                        node = _BrokerNode(name, self.run_dir / name, port, ha)
                        write_broker_config(node.folder, name, port, ha, self._broker_options)
                        self._nodes.append(node)
                    try:
                        self._namesrv = self._start_jvm("namesrv", deadline)
                        if self.tls:  # now that its certificate is made: the clients' settings load it as their CA
                            self.security = ClientSecurity(self.acl, tls=True, ca_file=str(self.tls_ca_file))
                        for node in self._nodes:
                            node.proc = self._start_broker_jvm(node, deadline)
                        for node in self._nodes:  # with the sentinel of the engine's look-ups (copy_finder)
                            self._wait_registered(node, deadline)
                            create_topics(node.addr, [SENTINEL_TOPIC], 1, timeout, self.security)
                        return
                    except PortTaken:
                        terminate([p for p in (self._namesrv, *(n.proc for n in self._nodes)) if p is not None], 10.0)
                        self._namesrv = None
                        self._nodes = []
                        if attempt == 2:
                            raise LocalRocketMQError(f"the local RocketMQ could not bind its ports three times: "
                                                     f"see {self._run_dir}") from None
            except BaseException:
                self._cleanup(10.0)
                raise

    def stop(self, timeout: float | None = None) -> None:
        """Stop Broker and NameServer (SIGTERM, SIGKILL after `timeout`); idempotent."""
        with self._lock:
            self._cleanup(self._stop_timeout if timeout is None else timeout)

    def stop_broker(self, timeout: float | None = None, *, kill: bool = False, index: int = 0) -> None:
        """Stop a broker only (the first, or the `index`th; SIGTERM then SIGKILL, or SIGKILL at once with
        `kill`), keeping its ports and store."""
        with self._lock:
            self._require_started()
            node = self._nodes[index]
            broker, node.proc = node.proc, None
            if broker is None or broker.poll() is not None:
                return
            if kill:
                # A crash, as a power cut or OOM killer would do it; the broker recovers its store
                # on the next start.
                broker.kill()
                broker.wait()
            else:
                terminate([broker], self._stop_timeout if timeout is None else timeout)
            # The NameServer drops the broker when its connection closes; wait for that, so that
            # start_broker() can tell the new registration from the old one.
            deadline = time.monotonic() + 10.0
            while self._broker_registered(node) and time.monotonic() < deadline:
                time.sleep(0.05)

    def start_broker(self, timeout: float = 120.0, *, index: int = 0) -> None:
        """Start a broker (the first, or the `index`th) again on the same ports and store, after stop_broker()."""
        with self._lock:
            self._require_started()
            node = self._nodes[index]
            if node.running:
                raise LocalRocketMQError(f"the broker {node.name} is already running")
            deadline = time.monotonic() + timeout
            try:
                node.proc = self._start_broker_jvm(node, deadline)
            except PortTaken as e:
                raise LocalRocketMQError(f"the broker {node.name} could not bind its old ports {node.port - 2}, "
                                         f"{node.port}, {node.ha_port} again: another process took one "
                                         f"(see {node.folder / 'broker.out'})") from e
            self._wait_registered(node, deadline)

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
        for node in self._nodes:
            try:
                create_topics(node.addr, topics, queues, timeout, self.security)
            except RemotingError as e:
                raise LocalRocketMQError(f"the broker at {node.addr} did not create topics {topics}: {e}") from e
        # The broker registers new topics with the NameServer itself; wait until every route is
        # visible, since a client that looks a topic up too early caches "no route" for a while.
        deadline = time.monotonic() + timeout
        namesrv = NameServerClient(self.namesrv_addr, timeout, self.security)
        try:
            for topic in topics:
                while len((namesrv.route_document(topic) or {}).get("brokerDatas") or []) < len(self._nodes):
                    if time.monotonic() > deadline:
                        raise LocalRocketMQError(f"topic {topic} has no route on the NameServer after {timeout} s")
                    time.sleep(0.05)
        except RemotingError as e:
            raise LocalRocketMQError(f"cannot read routes from the NameServer at {self.namesrv_addr}: {e}") from e
        finally:
            namesrv.close()

    def consumer_ids(self, group: str, timeout: float = 5.0) -> list[str]:
        """Client ids of the members of consumer group `group` the broker knows now ([] if none)."""
        self._require_started()
        try:
            return consumer_ids(self.broker_addr, group, timeout, self.security)
        except RemotingError as e:
            raise LocalRocketMQError(f"cannot ask the broker at {self.broker_addr} for group {group}: {e}") from e

    def consumer_lag(self, group: str, topic: str, timeout: float = 5.0) -> int:
        """Messages of `topic` that `group` has not committed yet, over all its queues."""
        self._require_started()
        try:
            return sum(consumer_lag(self.namesrv_addr, group, topic, timeout, self.security).values())
        except RemotingError as e:
            raise LocalRocketMQError(f"cannot ask for the lag of group {group} on {topic}: {e}") from e

    def mqadmin(self, *args: str, timeout: float = 120.0) -> str:
        """Run RocketMQ's own admin tool (`mqadmin`: `MQAdminStartup` from the broker's jars) against
        this NameServer with `args` (a sub-command and its options, `-n` added); its output.

        LocalRocketMQError if it exits non-zero or prints a failed sub-command."""
        self._require_started()
        assert self._java is not None and self._lib is not None
        tls = ["-Dtls.enable=true"] if self.tls else []
        if self._major < 5:
            write_legacy_logback(self.run_dir)
        cmd = [self._java, *MQADMIN_JVM, quiet_logback(self._major), *tls, "-cp", f"{self._lib}/*",
               "org.apache.rocketmq.tools.command.MQAdminStartup", *args, "-n", self.namesrv_addr]
        env = {**os.environ, "ROCKETMQ_HOME": str(self.run_dir)}
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False, env=env,
                                  cwd=self.run_dir)
        except subprocess.TimeoutExpired as e:
            raise LocalRocketMQError(f"mqadmin {' '.join(args)} did not finish in {timeout:.0f} s") from e
        out = proc.stdout + proc.stderr
        if proc.returncode != 0 or "command failed" in out:
            raise LocalRocketMQError(f"mqadmin {' '.join(args)} failed (exit {proc.returncode}):\n{out[-3000:]}")
        return proc.stdout

    # -- internals ----------------------------------------------------------------------------

    def _require_started(self) -> None:
        """Raise unless start() succeeded."""
        if self._namesrv is None or self._run_dir is None:
            raise LocalRocketMQError("the local RocketMQ has not been started: call start() first")

    def _broker_registered(self, node: _BrokerNode) -> bool:
        """Tell whether the NameServer lists this broker."""
        try:
            return broker_registered(self.namesrv_addr, node.addr, security=self.security)
        except RemotingError:
            return False

    def _start_jvm(self, name: str, deadline: float) -> subprocess.Popen[bytes]:
        """Start the NameServer and wait until it is up."""
        assert self._java is not None and self._lib is not None and name == "namesrv"
        run = self.run_dir
        tls = tuple(tls_jvm_flags(run)) if self.tls else ()
        if self._major < 5:
            write_legacy_logback(run)
        return start_jvm(self._java, self._lib, run, name, NAMESRV_READY, deadline,
                         "org.apache.rocketmq.namesrv.NamesrvStartup", (*NAMESRV_JVM, *tls),
                         ["-c", str(run / "namesrv.conf")], self._major)

    def _start_broker_jvm(self, node: _BrokerNode, deadline: float) -> subprocess.Popen[bytes]:
        """Start one broker from its folder and wait until it is up."""
        assert self._java is not None and self._lib is not None
        tls = tuple(tls_jvm_flags(self.run_dir)) if self.tls else ()
        if self._major < 5:
            write_legacy_logback(node.folder)
        return start_jvm(self._java, self._lib, node.folder, "broker", BROKER_READY, deadline,
                         "org.apache.rocketmq.broker.BrokerStartup", (*BROKER_JVM, *tls),
                         ["-c", str(node.folder / "broker.conf"), "-n", self.namesrv_addr], self._major)

    def _wait_registered(self, node: _BrokerNode, deadline: float) -> None:
        """Wait until the NameServer routes to the broker.

        "boot success" is printed once the broker's own start returns, but its first registration
        with the NameServer runs on another thread and, on a busy machine, can come seconds later;
        until then clients find no route.
        """
        while not self._broker_registered(node):
            if not node.running or time.monotonic() > deadline:
                log = node.folder / "logs" / "rocketmqlogs" / "broker.log"
                raise LocalRocketMQError(
                    f"the local RocketMQ broker {node.name} started but did not register with the NameServer; "
                    f"log tail of {log}:\n{tail(log, 15)}"
                )
            time.sleep(0.05)

    def _cleanup(self, timeout: float) -> None:
        """Stop whatever runs and remove a temporary run directory."""
        # Broker first so it can unregister from a NameServer that is still listening; both
        # shut down in parallel after that (the broker's graceful stop takes ~10 s).
        procs = [p for p in (*(n.proc for n in self._nodes), self._namesrv) if p is not None]
        self._namesrv = None
        for n in self._nodes:
            n.proc = None
        terminate(procs, timeout)
        if self._given_run_dir is None and self._run_dir is not None:
            shutil.rmtree(self._run_dir, ignore_errors=True)
        self._run_dir = None if self._given_run_dir is None else self._run_dir


def _make_run_dir(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # "File exists" would not say that it is there as a file
        why = "it is there and is not a directory" if isinstance(e, FileExistsError) else e.strerror or e
        raise LocalRocketMQError(f"cannot keep the local RocketMQ in {path}: {why}; give a directory instead") from e
    return path.resolve()


def run_foreground(dir: Path | None = None, acl: Credentials | None = None, tls: bool = False,
                   version: str | None = None) -> None:
    """Run a local RocketMQ until SIGINT/SIGTERM, printing `namesrv 127.0.0.1:PORT` once ready
    (with `acl`: authentication and authorization on, that user its administrator; with `tls`:
    TLS only, on a self-signed certificate; `version`: that RocketMQ release instead of the default)."""
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    # A temporary store is deleted on exit, so Ctrl-C need not wait for the broker's graceful
    # shutdown (10-20 s); a kept store gets it, so that the next run starts without recovery.
    mq = LocalRocketMQ(run_dir=dir, stop_timeout=30.0 if dir is not None else 3.0, acl=acl, tls=tls,
                       version=version or ROCKETMQ_VERSION)
    try:
        mq.start()
        print(f"namesrv {mq.namesrv_addr}", flush=True)
        if tls:
            print(f"TLS only, on a self-signed certificate: point the engine at it with [rocketmq] tls = true and "
                  f"tls_ca_file = \"{mq.tls_ca_file}\" (or tls_insecure = true, which checks no certificate)",
                  flush=True)
        while not stop.wait(0.5):
            if not mq.broker_running:
                raise LocalRocketMQError(f"the local RocketMQ broker exited unexpectedly: "
                                         f"see {mq.run_dir / 'broker.out'}")
    finally:
        mq.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
