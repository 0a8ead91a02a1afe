"""RocketMQ's own Java client, as an independent producer and consumer (conformance tests, benchmarks).

`forwarder/java/JavaClient.java` is compiled once per source and RocketMQ version with `javac`
against the local broker's Maven jars (the broker's distribution already carries RocketMQ's Java
client and its codecs), into the same cache directory. Nothing of timewheel is on its class path,
so what it sends and receives is what any Java user of RocketMQ would.
"""
from __future__ import annotations

import base64
import hashlib
import json
import queue
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from forwarder._local_process import major_version, quiet_logback
from forwarder.errors import LocalRocketMQError
from forwarder.local_rocketmq import ROCKETMQ_VERSION, default_cache_dir, ensure_distribution

_SOURCE = Path(__file__).with_name("java") / "JavaClient.java"
_JVM_FLAGS = ("-Xms64m", "-Xmx512m", "-Drocketmq.client.logLevel=ERROR")


@dataclass(frozen=True)
class JavaMessage:
    """A message as the Java client sends or received it."""

    topic: str
    body: bytes = b""
    tags: str | None = None
    keys: str | None = None
    props: Mapping[str, str] = field(default_factory=dict)
    msg_id: str | None = None
    received_ms: int | None = None

    def to_json(self) -> str:
        """One line of the producer's input."""
        return json.dumps({"topic": self.topic, "body": base64.b64encode(self.body).decode(), "tags": self.tags,
                           "keys": self.keys, "props": dict(self.props)})

    @classmethod
    def from_json(cls, row: Mapping[str, Any]) -> "JavaMessage":
        """One line of the consumer's output."""
        return cls(row["topic"], base64.b64decode(row.get("body") or ""), row.get("tags"), row.get("keys"),
                   dict(row.get("props") or {}), row.get("msgId"), row.get("receivedMs"))


class JavaClient:
    """Runs the compiled Java client against a NameServer, optionally with ACL credentials."""

    def __init__(self, namesrv: str, *, version: str = ROCKETMQ_VERSION, cache_dir: Path | None = None,
                 access_key: str | None = None, secret_key: str | None = None, tls: bool = False) -> None:
        """A client of the NameServer `namesrv`; signing with the ACL keys if given; over TLS with `tls`
        (RocketMQ's `-Dtls.enable=true`; the broker's certificate is not checked, as its test mode does)."""
        self.namesrv = namesrv
        self.tls = tls
        # each major version's logback kept from printing its own status (4's is not shaded)
        self.quiet = quiet_logback(major_version(version))
        self.lib = ensure_distribution(cache_dir, version)
        self.classes = _compile(self.lib, Path(cache_dir) if cache_dir else default_cache_dir(), version)
        self.credentials = (access_key, secret_key or "") if access_key else None

    def sign(self, requests: Iterable[tuple[Mapping[str, str], bytes, str, str]]) -> list[dict[str, str]]:
        """The ext fields RocketMQ's AclClientRPCHook sends for each (fields, body, access key, secret key)."""
        lines = [json.dumps({"fields": dict(f), "body": base64.b64encode(b).decode(), "ak": ak, "sk": sk})
                 for f, b, ak, sk in requests]
        return self._run(["sign"], "\n".join(lines) + "\n")

    def _command(self, args: list[str]) -> list[str]:
        tls = ["-Dtls.enable=true"] if self.tls else []
        cmd = ["java", *_JVM_FLAGS, self.quiet, *tls, "-cp", f"{self.classes}:{self.lib}/*", "JavaClient", *args,
               "--namesrv", self.namesrv]
        if self.credentials:
            cmd += ["--ak", self.credentials[0], "--sk", self.credentials[1]]
        return cmd

    def _run(self, args: list[str], stdin: str = "", timeout: float = 120.0) -> list[dict[str, Any]]:
        cmd = self._command(args)
        proc = subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=timeout, check=False)
        if proc.returncode != 0:
            raise LocalRocketMQError(f"the Java client exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
        return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]

    def produce(self, messages: Iterable[JavaMessage], *, compress: str = "zlib", compress_over: int = 4096,
                batch: bool = False, group: str = "java-conformance-producer",
                trace_topic: str | None = None, resend_after_ms: int | None = None) -> list[dict[str, Any]]:
        """Send messages (one at a time, or as one batch); one result per send: ok, msgId or error.
        With `trace_topic`, the client writes RocketMQ's message trace of its sends there; with
        `resend_after_ms`, each message is sent a second time that much later, as the client's retry
        of a send does (the same UNIQ_KEY, a new born time)."""
        args = ["produce", "--group", group, "--compress", compress, "--compress-over", str(compress_over)]
        if batch:
            args += ["--as-batch", "true"]
        if resend_after_ms is not None:
            args += ["--resend-after-ms", str(resend_after_ms)]
        if trace_topic:
            args += ["--trace", "true", "--trace-topic", trace_topic]
        return self._run(args, "\n".join(m.to_json() for m in messages) + "\n")

    def consume(self, topic: str, count: int, *, group: str, timeout_s: float = 60.0) -> list[JavaMessage]:
        """Receive up to `count` messages of `topic` under `group` (from the first offset)."""
        rows = self._run(["consume", "--topic", topic, "--group", group, "--count", str(count),
                          "--timeout-ms", str(int(timeout_s * 1000))], timeout=timeout_s + 60)
        return [JavaMessage.from_json(r) for r in rows if not r.get("done")]

    def intake(self, topic: str, *, seconds: int = 10, threads: int = 4, batch: int = 128,
               body_size: int = 100, props: Mapping[str, str] | None = None) -> dict[str, float]:
        """The broker's intake ceiling: batches from several threads for `seconds`; sent, seconds, rate.

        `props` go on every message (a delay topic's contract, to measure an engine's batch ingest)."""
        args = ["intake", "--topic", topic, "--seconds", str(seconds), "--threads", str(threads),
                "--batch", str(batch), "--body-size", str(body_size)]
        if props:
            args += ["--props", json.dumps(dict(props))]
        rows = self._run(args, timeout=seconds + 120)
        return {k: float(v) for k, v in rows[-1].items()}

    def pace(self, topic: str, *, rate: float, seconds: float, id_start: int, threads: int = 4, body_size: int = 100,
             target: str | None = None, delay_ms: tuple[int, int] = (1000, 10_000), seed: int = 7,
             warm_up_s: float = 0.0) -> dict[str, float]:
        """Messages at a steady `rate` for `warm_up_s` + `seconds`, numbered from `id_start` (property BENCH_ID)
        with their wanted time in BENCH_DUE_MS: delay messages to `target` due `delay_ms` later, or, without a
        target, plain messages stamped with their send time. Returns sent (after the warm-up), warm_up_sent,
        failed, seconds, rate (of all sent)."""
        args = ["pace", "--topic", topic, "--rate", str(rate), "--seconds", str(seconds), "--id-start", str(id_start),
                "--warm-up-seconds", str(warm_up_s), "--threads", str(threads), "--body-size", str(body_size),
                "--seed", str(seed)]
        if target:
            args += ["--target", target, "--delay-min-ms", str(delay_ms[0]), "--delay-max-ms", str(delay_ms[1])]
        rows = self._run(args, timeout=warm_up_s + seconds + 120)
        return {k: float(v) for k, v in rows[-1].items()}

    def lateness(self, topic: str, id_range: tuple[int, int], *, group: str, wait_s: float = 60.0,
                 idle_s: float = 20.0, threads: int = 4) -> "LatenessConsumer":
        """Start RocketMQ's push consumer on `topic` under the fresh `group`, measuring the lateness of the
        messages whose BENCH_ID is in `id_range` (start, stop) against their BENCH_DUE_MS; returns once it
        holds every queue of the topic. See `LatenessConsumer`."""
        return LatenessConsumer(self._command([
            "lateness", "--topic", topic, "--group", group, "--id-min", str(id_range[0]), "--id-max", str(id_range[1]),
            "--wait-ms", str(int(wait_s * 1000)), "--idle-ms", str(int(idle_s * 1000)), "--threads", str(threads)]))

    def noop(self, topic: str, count: int, *, group: str, batch: int = 32, timeout_s: float = 300.0,
             idle_s: float = 10.0) -> dict[str, float]:
        """RocketMQ's lite pull consumer reading `count` messages of `topic` from the first offset under the
        fresh `group`, doing nothing with them: received, seconds and rate from the first to the last
        message, wall_seconds with the start-up, the pull batch."""
        rows = self._run(["noop", "--topic", topic, "--group", group, "--count", str(count), "--batch", str(batch),
                          "--timeout-ms", str(int(timeout_s * 1000)), "--idle-ms", str(int(idle_s * 1000))],
                         timeout=timeout_s + 60)
        return {k: float(v) for k, v in rows[-1].items()}


class LatenessConsumer:
    """A running `lateness` consumer: `expect(n)` once the producer is done, then `result()`."""

    def __init__(self, cmd: list[str], ready_timeout: float = 120.0) -> None:
        """Start the process and wait for its ready line (it holds every queue of the topic)."""
        self._err = tempfile.TemporaryFile()
        self._lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True)
        threading.Thread(target=self._read, name="java-lateness-out", daemon=True).start()
        self.ready = self._line(ready_timeout)

    def expect(self, n: int) -> None:
        """Wait for `n` distinct messages (the count the broker accepted) and no more."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.close()

    def result(self, timeout: float) -> dict[str, Any]:
        """The consumer's summary: received, expected, complete, duplicates, other (outside the id range),
        queues, first_ms and last_ms (receive times), quantiles_ms (1001, from 0 to 100 %), by_second
        ([messages, p50, p99, max] for each second of receive time from the first arrival)."""
        try:
            out = self._line(timeout)
            self.proc.wait(30)
        finally:
            self.close()
        return out

    def _read(self) -> None:
        """Its JSON lines, then None at the end of its output."""
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self._lines.put(json.loads(line))
        self._lines.put(None)

    def _line(self, timeout: float) -> dict[str, Any]:
        """The next JSON line of its output; fails with its stderr if it ends or times out first."""
        try:
            row = self._lines.get(timeout=timeout)
        except queue.Empty:
            row = None
        if row is not None:
            return row
        self._kill()
        self._err.seek(0)
        err = self._err.read().decode(errors="replace").strip()[-2000:]
        self.close()
        raise LocalRocketMQError(f"the Java lateness consumer stopped or gave no answer in {timeout:.0f} s "
                                 f"(exit {self.proc.returncode}): {err}")

    def _kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        """Stop the process if it still runs."""
        self._kill()
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        self._err.close()

    def __enter__(self) -> "LatenessConsumer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _compile(lib: Path, cache_root: Path, version: str) -> Path:
    """Compile JavaClient.java once per source and version; the directory of its classes."""
    if shutil.which("javac") is None:
        raise LocalRocketMQError("javac is not on PATH: install a JDK 17 to compile RocketMQ's Java client harness")
    digest = hashlib.sha256(_SOURCE.read_bytes() + version.encode()).hexdigest()[:16]
    out = cache_root / f"java-client-{digest}"
    if (out / "JavaClient.class").exists():
        return out
    cache_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="java-client-", dir=cache_root))
    proc = subprocess.run(["javac", "-nowarn", "-d", str(staging), "-cp", f"{lib}/*", str(_SOURCE)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise LocalRocketMQError(f"javac failed on {_SOURCE.name}: {proc.stderr.strip()[-2000:]}")
    try:
        staging.rename(out)  # atomic: a concurrent compile of the same source loses the race harmlessly
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return out
