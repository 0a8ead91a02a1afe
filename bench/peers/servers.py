"""Redis and PostgreSQL servers on loopback, installed from Debian's packages if missing.

Each server runs on a free port with a temporary directory of its own, can be stopped and started
again on the same port and data (the restart measurement), and is stopped by `close()`.
"""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from bench.peers.common import free_port, remove_tree, terminate, tree_rss, wait_until


class ServerSetupError(RuntimeError):
    """A server could not be installed or started; the message says what to do."""


def ensure_debian_packages(binary: str, packages: list[str], search: list[str] | None = None) -> str:
    """Return the path of `binary`, installing `packages` with apt-get first if it is missing."""
    found = _find(binary, search)
    if found:
        return found
    if shutil.which("apt-get") is None:
        raise ServerSetupError(f"{binary} is missing and apt-get is not available: install {' '.join(packages)}")
    if os.geteuid() != 0:
        raise ServerSetupError(f"{binary} is missing: run `sudo apt-get install -y {' '.join(packages)}` "
                               "(the harness installs it itself only when run as root)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    print(f"installing {' '.join(packages)} with apt-get ...", flush=True)
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *packages]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise ServerSetupError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}): "
                                   f"{(proc.stderr or proc.stdout).strip()[-500:]}")
    # Debian starts the packaged service on install where an init system runs; ours are separate.
    found = _find(binary, search)
    if not found:
        raise ServerSetupError(f"{' '.join(packages)} installed but {binary} is still not found")
    return found


def _find(binary: str, search: list[str] | None) -> str | None:
    """`binary` on PATH or in the first matching `search` glob."""
    on_path = shutil.which(binary)
    if on_path:
        return on_path
    for pattern in search or []:
        hits = sorted(glob.glob(pattern), reverse=True)
        if hits:
            return hits[0]
    return None


class RedisServer:
    """`redis-server` on 127.0.0.1 with AOF persistence (appendfsync everysec) in a temp dir."""

    def __init__(self) -> None:
        """Prepare (not start) a server."""
        self.binary = ensure_debian_packages("redis-server", ["redis-server"])
        self.dir = Path(tempfile.mkdtemp(prefix="peers-redis-"))
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        (self.dir / "redis.conf").write_text(
            f"port {self.port}\nbind 127.0.0.1\nprotected-mode no\ndaemonize no\ndir {self.dir}\n"
            # Durable as RocketMQ's default async flush: an acknowledged write survives a crash of
            # the server process, at most a second of writes is lost on power loss.
            "appendonly yes\nappendfsync everysec\nsave \"\"\nlogfile redis.log\n"
        )

    def start(self, timeout: float = 60.0) -> None:
        """Start the server and wait until it answers PING (the data set is loaded then)."""
        import redis

        self.proc = subprocess.Popen([self.binary, str(self.dir / "redis.conf")], cwd=self.dir,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=1)

        def up() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServerSetupError(f"redis-server exited with {self.proc.returncode}: see {self.dir}/redis.log")
            try:
                return bool(client.ping())
            except redis.RedisError:
                return False

        if not wait_until(up, timeout, 0.02):
            raise ServerSetupError(f"redis-server did not answer within {timeout} s: see {self.dir}/redis.log")
        client.close()

    def stop(self) -> None:
        """Shut down gracefully (the AOF is flushed) and wait for the process."""
        import redis

        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            redis.Redis(port=self.port).shutdown()
        except redis.RedisError:
            pass  # the connection drops as the server exits
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            terminate(self.proc)
        self.proc = None

    def rss(self) -> int:
        """Resident bytes of the server process."""
        return tree_rss(self.proc.pid) if self.proc else 0

    def close(self) -> None:
        """Stop and delete the data."""
        try:
            self.stop()
        finally:
            if self.proc is not None:
                terminate(self.proc)
            remove_tree(self.dir)


class PostgresServer:
    """A PostgreSQL cluster made by `initdb` in a temp dir, run by `pg_ctl` on 127.0.0.1.

    PostgreSQL refuses to run as root: as root the cluster belongs to the `postgres` user (created
    if missing) and the commands run through `runuser`.
    """

    USER = "bench"
    DB = "postgres"

    def __init__(self) -> None:
        """initdb a cluster (not started)."""
        search = ["/usr/lib/postgresql/*/bin/pg_ctl"]
        self.pg_ctl = ensure_debian_packages("pg_ctl", ["postgresql"], search)
        bindir = Path(self.pg_ctl).resolve().parent
        self.initdb = str(bindir / "initdb")
        self.dir = Path(tempfile.mkdtemp(prefix="peers-pg-"))
        self.data = self.dir / "data"
        self.port = free_port()
        self._as: list[str] = []
        if os.geteuid() == 0:
            self._ensure_os_user("postgres")
            pw = pwd.getpwnam("postgres")
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]
        self._run([self.initdb, "-D", str(self.data), "-A", "trust", "-U", self.USER, "-E", "UTF8",
                   "--no-sync", "--no-instructions"], "initdb")
        with (self.data / "postgresql.conf").open("a") as f:
            f.write(f"port = {self.port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{self.dir}'\n"
                    # Commits flushed by the WAL writer within 200 ms: RocketMQ's default async flush.
                    "synchronous_commit = off\nmax_connections = 50\n")

    @staticmethod
    def _ensure_os_user(name: str) -> None:
        """Create a system user to own the cluster if there is none."""
        try:
            pwd.getpwnam(name)
        except KeyError:
            subprocess.run(["useradd", "--system", "--no-create-home", name], check=True)

    def _run(self, cmd: list[str], what: str) -> None:
        """Run a PostgreSQL command as the cluster's owner; raise with its output on failure."""
        proc = subprocess.run([*self._as, *cmd], capture_output=True, text=True, check=False, cwd="/")
        if proc.returncode != 0:
            raise ServerSetupError(f"{what} failed (exit {proc.returncode}): {(proc.stderr or proc.stdout).strip()[-800:]}")

    @property
    def conninfo(self) -> str:
        """libpq connection string."""
        return f"host=127.0.0.1 port={self.port} user={self.USER} dbname={self.DB}"

    def start(self) -> None:
        """Start the server (pg_ctl returns once it accepts connections)."""
        self._run([self.pg_ctl, "-D", str(self.data), "-l", str(self.dir / "server.log"), "-w", "-t", "120",
                   "start"], "pg_ctl start")

    def stop(self) -> None:
        """Fast shutdown: sessions are ended, the server checkpoints and exits."""
        if (self.data / "postmaster.pid").exists():
            self._run([self.pg_ctl, "-D", str(self.data), "-m", "fast", "-w", "-t", "120", "stop"], "pg_ctl stop")

    def postmaster_pid(self) -> int | None:
        """The running server's pid."""
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def rss(self) -> int:
        """Resident bytes of the server and its backends (shared buffers counted once per process)."""
        pid = self.postmaster_pid()
        return tree_rss(pid) if pid else 0

    def close(self) -> None:
        """Stop (immediately if needed) and delete the cluster."""
        try:
            self.stop()
        except ServerSetupError:
            pid = self.postmaster_pid()
            if pid:
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
                time.sleep(0.5)
        finally:
            remove_tree(self.dir)
