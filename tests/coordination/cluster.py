"""Real parts of a replica set for tests and drills: `timewheel serve` replicas started through the
CLI, a TCP proxy that can cut one replica off ZooKeeper, a producer of delay messages and cancels,
and a consumer of the target topic that records every delivery.

Used by `tests/coordination/test_replica_set.py`, `tests/coordination/test_nemesis.py` and
`python -m bench.nemesis`.
"""
from __future__ import annotations

import json
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Literal

from coordination import EPOCH_PROPERTY
from forwarder._rmq_native import LogLevel, NativeProducer, NativePushConsumer
from forwarder.contract import ORIGINAL_MSG_ID
from forwarder.errors import ForwarderError
from forwarder.rocketmq import OutgoingMessage, ReceivedMessage
from tests.polling import admin_ready
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


def now_ms() -> int:
    """The wall clock in epoch milliseconds."""
    return time.time_ns() // 1_000_000


class Replica:
    """One `timewheel serve` process of a shard, with its admin port."""

    def __init__(self, name: str, work: Path, env: dict[str, str], *, data_dir: Path | None = None,
                 replica_id: str | None = None, **extra: str) -> None:
        self.name, self.port = name, free_port()
        self.data_dir = data_dir or work / name
        self.log = work / f"{name}.log"
        with open(self.log, "ab") as err:  # the child writes to its own copy of the descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "timewheel", "serve", "--data-dir", str(self.data_dir), "--admin",
                 f"127.0.0.1:{self.port}", "--log-format", "json"], cwd=ROOT,
                env={**env, "TIMEWHEEL_HA_REPLICA_ID": replica_id or name, **extra}, stdout=subprocess.DEVNULL,
                stderr=err)

    def status(self, timeout: float = 2.0) -> dict[str, Any]:
        """The admin API's /status document."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/status", timeout=timeout) as resp:
            doc: dict[str, Any] = json.loads(resp.read())
            return doc

    def replica(self, timeout: float = 2.0) -> dict[str, Any]:
        """This replica's view of its lease (holder, epoch, watermarks, counters)."""
        r: dict[str, Any] = self.status(timeout)["ha"]["replica"]
        return r

    def wait_ready(self, timeout: float = 90.0) -> "Replica":
        """Wait until /readyz answers ready (fails if the process exits)."""
        wait_for(f"{self.name} ready", self._ready, timeout, self)
        return self

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"{self.name} exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
        return admin_ready(self.port)

    def holds(self) -> bool:
        """True if it answers that it holds the lease."""
        try:
            return bool(self.replica()["holder"])
        except (OSError, ValueError):
            return False

    @property
    def alive(self) -> bool:
        """The process has not exited."""
        return self.proc.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        """Send a signal to the process."""
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 60.0) -> None:
        """SIGCONT then SIGTERM, SIGKILL if it does not stop in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def wait_for(what: str, predicate: Callable[[], bool], timeout: float = 20.0, replica: Replica | None = None) -> None:
    """Poll `predicate` until true; AssertionError (with the replica's log tail) after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            tail = replica.log.read_text()[-2000:] if replica is not None else ""
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{tail}")
        time.sleep(0.05)


class TcpProxy:
    """A loopback TCP proxy to one upstream address that the caller can cut and heal.

    `cut("drop")` closes every connection and closes new ones at once (a host that refuses);
    `cut("blackhole")` keeps connections open but forwards nothing either way (a silent partition);
    `heal()` forwards again (blackholed connections are closed, their streams being out of step).
    """

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.rpartition(":")
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._mode: Literal["open", "drop", "blackhole"] = "open"
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._accept, name="tcp-proxy", daemon=True)
        self._thread.start()

    @property
    def mode(self) -> str:
        """"open", "drop" or "blackhole"."""
        return self._mode

    def cut(self, mode: Literal["drop", "blackhole"] = "drop") -> None:
        """Stop forwarding (see the class)."""
        with self._lock:
            self._mode = mode
            if mode == "drop":
                self._close_all()

    def heal(self) -> None:
        """Forward again."""
        with self._lock:
            if self._mode == "blackhole":
                self._close_all()
            self._mode = "open"

    def stop(self) -> None:
        """Close the listener and every connection."""
        self._stopping.set()
        self._thread.join(2)
        self._listener.close()
        with self._lock:
            self._close_all()

    def _close_all(self) -> None:
        for a, b in self._pairs:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()
        self._pairs.clear()

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                client, _ = self._listener.accept()
            except (TimeoutError, socket.timeout):
                continue
            except OSError:
                return
            with self._lock:
                mode = self._mode
            if mode == "drop":
                client.close()
                continue
            try:
                upstream = socket.create_connection(self._upstream, timeout=2)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._pairs.append((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        peer = {a: b, b: a}
        try:
            while not self._stopping.is_set():
                readable, _, _ = select.select([a, b], [], [], 0.2)
                for s in readable:
                    data = s.recv(65536)
                    if not data:
                        return
                    if self._mode == "open":
                        peer[s].sendall(data)
                    # blackhole: read and drop
        except (OSError, ValueError):
            return
        finally:
            with self._lock:
                if (a, b) in self._pairs:
                    self._pairs.remove((a, b))
            a.close()
            b.close()


@dataclass
class Sent:
    """One acknowledged delay message: when it was sent and when it is due (epoch ms)."""

    sent_ms: int
    due_ms: int
    msg_id: str
    cancel_acked_ms: int | None = None  # the cancel's acknowledgement; None: not cancelled
    cancel_unsure: bool = False  # a cancel whose outcome is unknown (it may or may not have applied)
    cancel_via: str = ""  # "topic", or "admin" (through some replica's admin API)

    @property
    def effective_ms(self) -> int:
        """When it should go out: its due time, or its sending if already past due."""
        return max(self.due_ms, self.sent_ms)


@dataclass
class Workload:
    """A producer of delay messages at `rate` a second: on time (due 2-20 s ahead), one in five
    already 1-60 s past due, and one in 25 due 12-20 s ahead and cancelled at once by id (every
    other cancel on the delay topic as `TW_CANCEL_ID`, the rest through a replica's admin API)."""

    namesrv: str
    delay_topic: str
    target: str
    run: str
    rate: float = 100.0
    admin_cancel: Callable[[str], bool] | None = None  # cancel by id through some replica's admin API
    sent: dict[bytes, Sent] = field(default_factory=dict)
    unacked: int = 0

    def __post_init__(self) -> None:
        self._producer = NativeProducer(f"nemesis_producer_{self.run}", self.namesrv, log_level=LogLevel.ERROR)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._produce, name="workload", daemon=True)

    def start(self) -> "Workload":
        """Start producing."""
        self._producer.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop producing (the producer is shut down)."""
        self._stop.set()
        self._thread.join(60)
        self._producer.shutdown()

    def snapshot(self) -> dict[bytes, Sent]:
        """A copy of what was acknowledged so far."""
        with self._lock:
            return dict(self.sent)

    def _send(self, msg: OutgoingMessage) -> str | None:
        for _ in range(5):
            if self._stop.is_set():
                return None
            try:
                return self._producer.send(msg).msg_id
            except ForwarderError:
                time.sleep(0.2)
        return None

    def plan(self, i: int, now: int) -> tuple[int, bool]:
        """The `i`-th message's due time (epoch ms) and whether it is cancelled at once."""
        if i % 5 == 0:
            return now - 1_000 - (i * 7919) % 59_000, False
        if i % 25 == 3:
            return now + 12_000 + (i * 7919) % 8_000, True
        return now + 2_000 + (i * 7919) % 18_000, False

    def _produce(self) -> None:
        t0, i, n = time.monotonic(), 0, 0
        while not self._stop.is_set():
            body = f"{self.run}-{i}".encode()
            now = now_ms()
            due, cancel = self.plan(i, now)
            msg_id = self._send(OutgoingMessage(self.delay_topic, body, None, None, {
                "TW_TARGET_TOPIC": self.target, "TW_DELIVER_AT_MS": str(due)}))
            if msg_id is None:
                self.unacked += 1
            else:
                with self._lock:
                    self.sent[body] = Sent(now, due, msg_id)
                if cancel:
                    self._cancel(body, msg_id, via_admin=(i // 25) % 2 == 1)
            i += 1
            n += 1
            behind = t0 + n / self.rate - time.monotonic()
            if behind < -1.0:  # after a stall (a broker down), carry on at the rate instead of bursting
                t0, n = time.monotonic(), 0
            else:
                time.sleep(max(0.0, behind))

    def _cancel(self, body: bytes, msg_id: str, via_admin: bool) -> None:
        ok: bool | None
        if via_admin and self.admin_cancel is not None:
            try:
                ok = self.admin_cancel(msg_id)
            except OSError:
                ok = None  # unknown: it may have applied on the replica that was asked
        else:
            ok = self._send(OutgoingMessage(self.delay_topic, b"cancel", None, None, {"TW_CANCEL_ID": msg_id})) \
                is not None or None
        with self._lock:
            self.sent[body].cancel_via = "admin" if via_admin and self.admin_cancel is not None else "topic"
            if ok:
                self.sent[body].cancel_acked_ms = now_ms()
            else:
                self.sent[body].cancel_unsure = True


@dataclass(frozen=True)
class Delivery:
    """One copy received from the target topic: its lease epoch, and when and where the broker stored it."""

    epoch: int
    store_ms: int
    broker: str  # "" when the client does not name it (the native consumer does not; the harnesses run one broker)
    queue_id: int
    queue_offset: int

    @classmethod
    def of(cls, m: ReceivedMessage) -> Delivery:
        """The copy `m` as the consumer received it."""
        return cls(int(m.properties.get(EPOCH_PROPERTY, "-1")), m.store_timestamp, m.broker, m.queue_id,
                   m.queue_offset)


def at_most_one_send_batch(copies: Iterable[Delivery]) -> bool:
    """Whether `copies` can all have been stored by one SEND_BATCH request (true of none).

    The broker stores a batch on the one queue its request names, as one run of queue offsets,
    and stamps all of it with one store time (docs/HA.md, fencing): one store time alone would
    take two batches stored in the same millisecond for one.
    """
    # a copy the consumer received twice is still one stored message: count what was stored, not copies
    stored = {(d.broker, d.queue_id, d.queue_offset, d.store_ms) for d in copies}
    if not stored:
        return True
    offsets = sorted({offset for _, _, offset, _ in stored})
    return (len({(broker, queue) for broker, queue, _, _ in stored}) == 1 and len({ms for *_, ms in stored}) == 1
            and offsets[-1] - offsets[0] + 1 == len(offsets))


def stored_where(copies: Iterable[Delivery]) -> str:
    """When and where `copies` were stored, by store time and queue (for a failure to show)."""
    runs: dict[tuple[int, str, int], set[int]] = {}
    for d in copies:
        runs.setdefault((d.store_ms, d.broker, d.queue_id), set()).add(d.queue_offset)
    shown = [f"at {ms} on {broker or 'the broker'}:{queue} offsets {_offsets(sorted(offsets))}"
             for (ms, broker, queue), offsets in sorted(runs.items())]
    return "; ".join(shown[:6]) + (f"; and {len(shown) - 6} more" if len(shown) > 6 else "")


def _offsets(offsets: list[int]) -> str:
    if offsets[-1] - offsets[0] + 1 == len(offsets):
        return f"{offsets[0]}-{offsets[-1]}" if len(offsets) > 1 else str(offsets[0])
    return ",".join(map(str, offsets[:8])) + (",..." if len(offsets) > 8 else "")


class Deliveries:
    """A push consumer of the target topic recording every copy by body with its lease epoch."""

    def __init__(self, namesrv: str, target: str, run: str) -> None:
        self._lock = threading.Lock()
        self.copies: dict[bytes, list[Delivery]] = {}
        self.missing_original_id = 0
        self._consumer = NativePushConsumer(f"nemesis_consumer_{run}", namesrv, self._on, log_level=LogLevel.ERROR)
        self._consumer.subscribe(target)

    def start(self) -> "Deliveries":
        """Start consuming."""
        self._consumer.start()
        return self

    def stop(self) -> None:
        """Stop consuming."""
        self._consumer.shutdown()

    def _on(self, m: ReceivedMessage) -> bool:
        with self._lock:
            self.copies.setdefault(m.body, []).append(Delivery.of(m))
            if not m.properties.get(ORIGINAL_MSG_ID):
                self.missing_original_id += 1
        return True

    def snapshot(self) -> dict[bytes, list[Delivery]]:
        """A copy of every delivery so far."""
        with self._lock:
            return {k: list(v) for k, v in self.copies.items()}
