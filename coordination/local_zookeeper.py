"""A real Apache ZooKeeper on loopback, for tests, the demo and `timewheel zookeeper`.

`LocalZooKeeper` runs one standalone server (`ZooKeeperServerMain`) in a JVM of its own, from the
Maven Central jars cached by `coordination._zk_distribution`, with a run directory of its own
(zoo.cfg, data, logs, JVM output), on a free loopback port. It is ready when it answers the `ruok`
four-letter command with `imok`; `stop()` ends it with SIGTERM (SIGKILL after a grace period).
"""
from __future__ import annotations

import concurrent.futures
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from coordination._zk_distribution import ZOOKEEPER_VERSION, ensure_zookeeper, find_java
from coordination.errors import LocalZooKeeperError

__all__ = ["LocalZooKeeper", "ruok", "run_foreground"]

# Below Linux's default ephemeral range, like the local RocketMQ's ports.
_PORT_RANGE = (20000, 32000)
#: ZooKeeper's tick: sessions may last 2 to 120 ticks, so 500 ms allows timeouts of 1 s to 60 s
_TICK_MS = 500

_PDEATHSIG = shutil.which("setpriv")
# Forked from one long-lived thread: with `setpriv --pdeathsig` the JVM gets SIGTERM when the
# thread that forked it ends, so a crashed test session leaves no server behind.
_LAUNCHER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="zookeeper-launcher")


def ruok(address: str, timeout: float = 1.0) -> bool:
    """True when the server at HOST:PORT answers ZooKeeper's `ruok` with `imok`."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout) as s:
            s.sendall(b"ruok")
            return s.recv(16) == b"imok"
    except OSError:
        return False


class LocalZooKeeper:
    """A standalone ZooKeeper server on a loopback port, with its own data directory."""

    def __init__(self, run_dir: Path | None = None, *, cache_dir: Path | None = None,
                 version: str = ZOOKEEPER_VERSION, port: int | None = None) -> None:
        """Prepare (not start); `run_dir` None means a temporary directory, `port` None a free one."""
        self._given_run_dir = Path(run_dir) if run_dir is not None else None
        self._cache_dir = cache_dir
        self._version = version
        self._port = port or 0
        self._run_dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def connect_string(self) -> str:
        """What clients connect to, "127.0.0.1:PORT"."""
        if self._proc is None:
            raise LocalZooKeeperError("the local ZooKeeper has not been started: call start() first")
        return f"127.0.0.1:{self._port}"

    @property
    def run_dir(self) -> Path:
        """The directory holding zoo.cfg, the data, the server log and the JVM's output."""
        if self._run_dir is None:
            raise LocalZooKeeperError("the local ZooKeeper has not been started: call start() first")
        return self._run_dir

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def start(self, timeout: float = 120.0) -> "LocalZooKeeper":
        """Download the jars if needed, start the server and wait until it answers `ruok`; after `stop()`, again
        on the same port and data directory (delete `run_dir / "data"` first for an empty server)."""
        if self._proc is not None:
            raise LocalZooKeeperError("the local ZooKeeper is already started")
        if self._given_run_dir is not None:  # refused before java (a JVM) is looked for and jars fetched
            self._run_dir = _make_run_dir(self._given_run_dir)
        java = find_java()
        lib = ensure_zookeeper(self._cache_dir, self._version)
        if self._run_dir is None:  # a temporary one, kept across a stop and start: its data, as a restarted server's
            self._run_dir = Path(tempfile.mkdtemp(prefix="timewheel-zookeeper-"))
        deadline = time.monotonic() + timeout
        for attempt in range(3):
            port = self._port or _free_port(random.Random())
            self._write_config(port)
            out = self.run_dir / "zookeeper.out"
            cmd = [java, "-Xms32m", "-Xmx128m", "-XX:-UsePerfData", "-Djava.net.preferIPv4Stack=true",
                   f"-Dorg.slf4j.simpleLogger.logFile={self.run_dir / 'zookeeper.log'}",
                   "-Dorg.slf4j.simpleLogger.showDateTime=true", "-Dzookeeper.admin.enableServer=false",
                   "-cp", f"{lib}{os.sep}*", "org.apache.zookeeper.server.ZooKeeperServerMain",
                   str(self.run_dir / "zoo.cfg")]
            proc = _launch(cmd, out, self.run_dir)
            self._port, self._proc = port, proc
            while time.monotonic() < deadline and proc.poll() is None:
                if ruok(f"127.0.0.1:{port}", 0.5):
                    return self
                time.sleep(0.1)
            self._terminate(5.0)
            text = _tail(self.run_dir / "zookeeper.log") + _tail(out)
            if "Address already in use" in text and attempt < 2 and time.monotonic() < deadline:
                self._port = 0  # taken between our check and the bind: another port
                continue
            raise LocalZooKeeperError(f"the local ZooKeeper did not come up (see {self.run_dir}):\n{text[-3000:]}")
        raise LocalZooKeeperError(f"the local ZooKeeper could not bind a port three times: see {self.run_dir}")

    def stop(self, timeout: float = 15.0) -> None:
        """Stop the server (SIGTERM, SIGKILL after `timeout`); idempotent. The run directory stays."""
        self._terminate(timeout)

    def __enter__(self) -> "LocalZooKeeper":
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def _terminate(self, timeout: float) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def _write_config(self, port: int) -> None:
        run = self.run_dir
        (run / "data").mkdir(exist_ok=True)
        (run / "zoo.cfg").write_text(
            f"tickTime={_TICK_MS}\n"
            f"dataDir={run / 'data'}\n"
            f"clientPort={port}\n"
            "clientPortAddress=127.0.0.1\n"
            f"minSessionTimeout={2 * _TICK_MS}\n"
            f"maxSessionTimeout={120 * _TICK_MS}\n"
            "maxClientCnxns=200\n"
            "admin.enableServer=false\n"
            "4lw.commands.whitelist=ruok,srvr,mntr,stat\n"
            # snapshots and transaction logs of a test server never need purging by hand
            "autopurge.snapRetainCount=3\n"
            "autopurge.purgeInterval=1\n")


def _make_run_dir(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # "File exists" would not say that it is there as a file
        why = "it is there and is not a directory" if isinstance(e, FileExistsError) else e.strerror or e
        raise LocalZooKeeperError(f"cannot keep the local ZooKeeper in {path}: {why}; give a directory instead") from e
    return path.resolve()


def _launch(cmd: list[str], out_path: Path, cwd: Path) -> subprocess.Popen[bytes]:
    if _PDEATHSIG is not None:
        cmd = [_PDEATHSIG, "--pdeathsig", "TERM", "--", *cmd]

    def spawn() -> subprocess.Popen[bytes]:
        with out_path.open("ab") as out:
            return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                                    start_new_session=True)

    return _LAUNCHER.submit(spawn).result()


def _free_port(rng: random.Random) -> int:
    low, high = _PORT_RANGE
    for _ in range(500):
        port = rng.randrange(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise LocalZooKeeperError(f"no free loopback port in {low}-{high}: free some ports")


def _tail(path: Path, size: int = 4000) -> str:
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - size))
            return f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def run_foreground(dir: Path | None = None) -> None:
    """Run a local ZooKeeper until SIGINT/SIGTERM, printing `zookeeper 127.0.0.1:PORT` once ready."""
    import threading
    from types import FrameType

    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    zk = LocalZooKeeper(run_dir=dir)
    try:
        zk.start()
        print(f"zookeeper {zk.connect_string}", flush=True)
        while not stop.wait(0.5):
            if zk.pid is None:
                raise LocalZooKeeperError(f"the local ZooKeeper exited unexpectedly: see "
                                          f"{zk.run_dir / 'zookeeper.log'}")
    finally:
        zk.stop()
        if dir is None and zk._run_dir is not None:
            shutil.rmtree(zk._run_dir, ignore_errors=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
