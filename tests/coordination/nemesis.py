"""A fault-injection harness in Jepsen's shape on real parts: one shard, 2 or 3 `timewheel serve`
replicas on a real RocketMQ and a real ZooKeeper, a steady workload, and a nemesis that injects one
fault a round; a checker then reads what the target topic really received.

Faults (one a round, in this order, round after round):

- `kill`: SIGKILL the holder; restarted on its data directory once a standby holds.
- `pause`: SIGSTOP the holder past its session, then SIGCONT; it must send nothing after resuming.
- `partition`: cut the holder off ZooKeeper at its proxy (refused connections or a blackhole, in
  turn) past its session, then heal; it must send nothing once its fencing deadline has passed.
- `skew`: restart a standby with its clock skewed (`engine.clock_offset_ms`, +3 s and -3 s in
  turn), kill the holder so that a skewed replica holds, restart the killed one, then restart the
  skewed one with its true clock (SIGTERM: a graceful hand-over).
- `broker`: kill the broker (SIGKILL) and start it again on its store.
- `wipe`: SIGKILL a standby, delete its data directory and restart it under the same id (a new
  directory reads every queue from its earliest retained offset and is not eligible for the lease
  until it has read them to the end). It must not hold the lease meanwhile: the round keeps the
  holder running for the workload's longest delay and checks that the wiped replica never held
  before it had caught up.
- `wipe_takeover`: as `wipe`, then kill the holder at once, so that the only replica left is the
  wiped one: it takes the lease once caught up, and must send everything the killed holder had
  not (nothing lost, takeover within 10 s).
- `dupid`: start a further process with the holder's (or a standby's) `replica_id`: it must be
  refused and exit non-zero, and the lease must not move.
- `zookeeper_restart`: stop ZooKeeper for longer than the session, then start it again on its data
  and port. Nothing may be stored on the target from the holder's fencing deadline until ZooKeeper
  is back; then one replica holds again (the same, its session kept by the server, or a successor
  with a larger epoch) and every replica is ready.
- `zookeeper_wipe`: the same, but ZooKeeper comes back empty (its data directory deleted: a rebuilt
  ensemble). It refuses every client that saw a later transaction than its own last, so each replica
  must say so and exit with code 3; the round restarts them, as a supervisor does, and one holds
  with epochs from 1 again (the checker tells the two runs of epochs apart by when the copies were
  stored). Nothing may be stored from the fencing deadline until the first replica is started again.
- `zookeeper_ahead`: the same, but ZooKeeper comes back on another ensemble's data, whose clients took
  it past every transaction the replicas saw (a new ensemble, another cluster's backup) and which lacks
  the shard's tree: it takes the replicas back in new sessions, so each must find the lease path it
  joined gone, say so and exit with code 3; then as `zookeeper_wipe`.

Checked (`Report.failures`): every acknowledged message not cancelled is delivered; no message
whose cancel was acknowledged at least 1 s (plus any clock skew in force) before its due time is
delivered; every takeover within 10 s of its fault; the duplicates of each failover within the
bound of docs/HA.md: the messages that were to go out between two watermark intervals plus 0.5 s
before the fault and the fault (plus the fencing period for a partition, and the old holder's clock
offset when ahead); no copy stamped with a paused or partitioned holder's epoch stored after its
deadline, but for a paused holder's one send batch in flight at the pause (one store time, one queue,
one run of queue offsets); a refused duplicate id exited non-zero without moving the lease; no copy
stored while no replica could confirm a lease (ZooKeeper down or empty); ZooKeeper's faults taken
over from within their own bounds, counted from when it was back.
"""
from __future__ import annotations

import argparse
import bisect
import dataclasses
import itertools
import json
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Literal

from kazoo.client import KazooClient

from coordination import LocalZooKeeper
from forwarder.local_rocketmq import LocalRocketMQ
from tests.coordination.cluster import (Deliveries, Delivery, Replica, Sent, TcpProxy, Workload,
                                     at_most_one_send_batch, now_ms, stored_where, wait_for)
from tests.forwarder.dedupe_checker import TopicReader
from tests.reliability.kill_loop import serve_env

FAULTS = ("kill", "pause", "partition", "skew", "broker", "wipe", "wipe_takeover", "dupid", "zookeeper_restart",
          "zookeeper_wipe", "zookeeper_ahead")
SESSION_S = 4.0
WATERMARK_S = 1.0
FENCE_FRACTION = 0.6
PUBLISH_SLACK_MS = 500
TAKEOVER_BOUND_S = 10.0
SKEW_MS = 3_000
LONGEST_DELAY_MS = 20_000  # the workload's longest delay: what a wiped replica reads again has come due after it
TOKEN = "nemesis"
#: from ZooKeeper back to a holder: a reconnect after kazoo's backoff (it doubles while ZooKeeper is
#: down) and, when the holder's session expired meanwhile, the session timeout
ZK_RESTART_BOUND_S = 20.0
#: from an empty ZooKeeper (or another ensemble's) back to a holder: two probes, the replicas' exits and starts
ZK_WIPE_BOUND_S = 90.0
#: another ensemble's data is this many transactions past the last the replicas could have seen
AHEAD_BY = 1_000
#: a wiped ZooKeeper numbers epochs from 1 again: the monitor and the checker add this per reset
ERA = 1_000_000


@dataclass
class Failover:
    """One change of holder: the fault's time, when the new holder was seen, the epochs."""

    fault_ms: int
    seen_ms: int
    old_epoch: int
    new_epoch: int
    extra_ms: int = 0  # the old holder may have sent this long after the fault (fencing period, clock ahead)
    planned: bool = True
    dups: int = 0  # messages delivered again by the new holder (found by the checker)
    bound: int = 0  # what docs/HA.md allows (found by the checker)
    healed_ms: int = 0  # when set (ZooKeeper back), the takeover is counted from it
    limit_s: float = TAKEOVER_BOUND_S

    @property
    def takeover_s(self) -> float:
        """From the fault (or its healing, when the fault stopped every replica) to the new holder seen."""
        return (self.seen_ms - (self.healed_ms or self.fault_ms)) / 1000


@dataclass
class Round:
    """What one round did and saw."""

    number: int
    fault: str
    start_ms: int
    end_ms: int = 0
    holder_before: str = ""
    holder_after: str = ""
    failovers: list[Failover] = field(default_factory=list)
    #: copies stamped with this epoch and stored by the broker after this time are a fencing failure
    fenced: list[tuple[int, int]] = field(default_factory=list)
    #: (from, to) ms: no replica could confirm a lease, so a copy stored in between is a fencing failure
    silent: list[tuple[int, int]] = field(default_factory=list)
    epoch_reset_ms: int = 0  # ZooKeeper came back empty: epochs count from 1 again from here
    skew_ms: int = 0
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


@dataclass
class Row:
    """One line of the table."""

    number: int
    fault: str
    holder_before: str
    holder_after: str
    takeover_s: str
    acked: int
    delivered: int
    lost: str
    cancelled_delivered: str
    duplicates: int
    resent: int
    bound: str


class Monitor:
    """Polls every replica's /status and records each (holder, epoch) it sees first."""

    def __init__(self, replicas: Callable[[], dict[str, Replica]]) -> None:
        self._replicas = replicas
        self._lock = threading.Lock()
        self.epochs: dict[int, tuple[str, int]] = {}  # epoch (+ ERA per ZooKeeper reset) -> (holder, first seen ms)
        self.current: tuple[str, int] = ("", 0)
        self.base = 0  # ERA times the resets of ZooKeeper so far
        self.holder_seen_ms = 0  # the last poll that found a replica holding
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="holder-monitor", daemon=True)

    def start(self) -> "Monitor":
        """Start polling."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling."""
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(0.1)

    def poll(self) -> None:
        """One look at every replica."""
        results: dict[str, tuple[bool, int]] = {}

        def ask(name: str, r: Replica) -> None:
            try:
                doc = r.replica(timeout=0.5)
                results[name] = (bool(doc["holder"]), int(doc["epoch"]))
            except (OSError, ValueError, KeyError):
                pass

        threads = [threading.Thread(target=ask, args=item, daemon=True) for item in self._replicas().items()
                   if item[1].alive]
        for t in threads:
            t.start()
        for t in threads:
            t.join(1)
        seen = now_ms()
        with self._lock:
            holders = [(name, self.base + epoch) for name, (holding, epoch) in list(results.items()) if holding]
            if holders:
                self.holder_seen_ms = seen
            for name, epoch in holders:
                if epoch not in self.epochs:
                    self.epochs[epoch] = (name, seen)
                if epoch >= self.current[1]:
                    self.current = (name, epoch)

    def holder(self) -> tuple[str, int]:
        """The newest holder seen and its epoch."""
        with self._lock:
            return self.current

    def new_era(self) -> int:
        """ZooKeeper comes back empty (call once no replica holds): epochs seen from now on count from 1
        again, recorded above every earlier one; the new base."""
        with self._lock:
            self.base += ERA
            self.current = ("", self.base)
            return self.base

    def wait_epoch_above(self, epoch: int, timeout: float) -> tuple[str, int, int]:
        """Wait for a holder with a larger epoch; (name, epoch, first seen ms)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                newer = sorted(e for e in self.epochs if e > epoch)
                if newer:
                    name, seen = self.epochs[newer[0]]
                    return name, newer[0], seen
            time.sleep(0.05)
        raise AssertionError(f"no replica took the lease over from epoch {epoch} within {timeout:.0f} s")


class Cluster:
    """One shard's replicas (each behind its own ZooKeeper proxy), the workload and the deliveries."""

    def __init__(self, rocketmq: LocalRocketMQ, zookeeper: LocalZooKeeper, work: Path, *, replicas: int = 2,
                 rate: float = 100.0) -> None:
        self.mq, self.zk, self.work = rocketmq, zookeeper, work
        self.run = uuid.uuid4().hex[:8]
        self.delay_topic, self.target = f"TW_DELAY_{self.run}", f"NEMESIS_{self.run}"
        self.names = [f"r{k}" for k in range(replicas)]
        self.env = serve_env(rocketmq, self.run, TIMEWHEEL_HA_SESSION_TIMEOUT_S=str(SESSION_S),
                             TIMEWHEEL_HA_WATERMARK_INTERVAL_S=str(WATERMARK_S),
                             TIMEWHEEL_HA_FENCE_FRACTION=str(FENCE_FRACTION), TIMEWHEEL_ADMIN_TOKEN=TOKEN)
        self.proxies = {name: TcpProxy(zookeeper.connect_string) for name in self.names}
        self.replicas: dict[str, Replica] = {}
        self.offsets: dict[str, int] = {name: 0 for name in self.names}
        self.monitor = Monitor(lambda: dict(self.replicas))
        self.rate = rate
        self.workload: Workload | None = None
        self.deliveries: Deliveries | None = None
        self.rounds: list[Round] = []
        self._starts = itertools.count()

    # ---- replicas -----------------------------------------------------------------------------------

    def start_replica(self, name: str, *, offset_ms: int = 0, replica_id: str | None = None,
                      data_dir: Path | None = None, extra: dict[str, str] | None = None) -> Replica:
        """Start replica `name` (behind its proxy, `extra` added to its environment) and wait until it is ready."""
        self.offsets[name] = offset_ms
        r = Replica(name, self.work, self.env, data_dir=data_dir, replica_id=replica_id,
                    TIMEWHEEL_HA_ZOOKEEPER=self.proxies[name].address,
                    TIMEWHEEL_ENGINE_CLOCK_OFFSET_MS=str(offset_ms), **(extra or {}))
        self.replicas[name] = r
        return r.wait_ready()

    def restart_replica(self, name: str, *, offset_ms: int = 0, timeout: float = 60.0,
                        extra: dict[str, str] | None = None) -> Replica:
        """Start `name` again on its data directory, retrying while its old session still holds its id."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.start_replica(name, offset_ms=offset_ms, extra=extra)
            except AssertionError:
                if time.monotonic() > deadline or "already live" not in self.replicas[name].log.read_text()[-4000:]:
                    raise
                time.sleep(1.0)

    def standbys(self) -> list[str]:
        """Live replicas that do not hold the lease."""
        holder = self.monitor.holder()[0]
        return [n for n in self.names if n != holder and self.replicas[n].alive]

    def admin_cancel(self, msg_id: str) -> bool:
        """Cancel by id through the admin API of the first live replica that takes it (a cancel is
        idempotent: one refused by a replica that is stopping, or that reached only some queues, is
        asked of the next); False if every replica that answered refused it."""
        refused = False
        for name in self.names:
            r = self.replicas.get(name)
            if r is None or not r.alive:
                continue
            req = urllib.request.Request(f"http://127.0.0.1:{r.port}/cancel?id={msg_id}", method="POST",
                                         headers={"Authorization": f"Bearer {TOKEN}"})
            try:
                with urllib.request.urlopen(req, timeout=3) as resp:
                    if resp.status == 200:
                        return True
                    refused = True
            except urllib.error.HTTPError:
                refused = True  # 503: not applied, or not on every queue (it may have applied here)
            except OSError:
                continue
        if refused:
            return False
        raise OSError("no replica answered")

    def start(self) -> "Cluster":
        """Topics, the first replica (it holds), the others, the consumer and the workload."""
        self.mq.create_topics([self.delay_topic], queues=4)
        self.mq.create_topics([f"TW_DLQ_{self.run}", self.target])
        self.deliveries = Deliveries(self.mq.namesrv_addr, self.target, self.run).start()
        first = self.start_replica(self.names[0])
        wait_for("the first replica holds the lease", first.holds, 30, first)
        for name in self.names[1:]:
            self.start_replica(name)
        self.monitor.start()
        wait_for("the monitor sees the holder", lambda: self.monitor.holder()[1] > 0, 10)
        self.workload = Workload(self.mq.namesrv_addr, self.delay_topic, self.target, self.run, self.rate,
                                 admin_cancel=self.admin_cancel).start()
        return self

    def stop(self) -> None:
        """Stop everything this cluster started."""
        if self.workload is not None:
            self.workload.stop()
        self.monitor.stop()
        for r in self.replicas.values():
            r.stop()
        for p in self.proxies.values():
            p.stop()
        if self.deliveries is not None:
            self.deliveries.stop()
        if not self.mq.broker_running:
            self.mq.start_broker()
        if self.zk.pid is None:  # a round that failed with ZooKeeper down: whoever shares it finds it up
            self.zk.start()

    # ---- rounds -------------------------------------------------------------------------------------

    def run_round(self, fault: str, settle_s: float = 3.0) -> Round:
        """Inject one fault, heal, let things settle; the round's record."""
        holder, epoch = self.monitor.holder()
        rnd = Round(len(self.rounds) + 1, fault, now_ms(), holder_before=holder)
        self.rounds.append(rnd)
        getattr(self, f"_fault_{fault}")(rnd, holder, epoch)
        time.sleep(settle_s)
        rnd.holder_after = self.monitor.holder()[0]
        rnd.end_ms = now_ms()
        return rnd

    def _takeover(self, rnd: Round, fault_ms: int, epoch: int, extra_ms: int = 0) -> tuple[str, int]:
        name, new_epoch, seen = self.monitor.wait_epoch_above(epoch, 30)
        rnd.failovers.append(Failover(fault_ms, seen, epoch, new_epoch, extra_ms))
        return name, new_epoch

    def _fault_kill(self, rnd: Round, holder: str, epoch: int) -> None:
        fault_ms = now_ms()
        self.replicas[holder].signal(signal.SIGKILL)
        self.replicas[holder].proc.wait()
        self._takeover(rnd, fault_ms, epoch, max(0, self.offsets[holder]))
        self.restart_replica(holder)

    def _fault_pause(self, rnd: Round, holder: str, epoch: int) -> None:
        r = self.replicas[holder]
        fault_ms = now_ms()
        r.signal(signal.SIGSTOP)
        self._takeover(rnd, fault_ms, epoch, max(0, self.offsets[holder]))
        time.sleep(max(0.0, (fault_ms + SESSION_S * 1000 + 3000 - now_ms()) / 1000))
        r.signal(signal.SIGCONT)
        rnd.fenced.append((epoch, now_ms()))
        wait_for(f"{holder} answers again, as a standby",
                 lambda: answers_as_standby(r), 30, r)

    def _fault_partition(self, rnd: Round, holder: str, epoch: int) -> None:
        mode: Literal["drop", "blackhole"] = (
            "blackhole" if sum(1 for x in self.rounds if x.fault == "partition") % 2 == 0 else "drop")
        rnd.notes.append(mode)
        fence_ms = int(FENCE_FRACTION * SESSION_S * 1000)
        fault_ms = now_ms()
        self.proxies[holder].cut(mode)
        rnd.fenced.append((epoch, fault_ms + fence_ms + PUBLISH_SLACK_MS))
        self._takeover(rnd, fault_ms, epoch, fence_ms + max(0, self.offsets[holder]))
        time.sleep(max(0.0, (fault_ms + SESSION_S * 1000 + 2000 - now_ms()) / 1000))
        self.proxies[holder].heal()
        r = self.replicas[holder]
        wait_for(f"{holder} answers again, as a standby", lambda: answers_as_standby(r), 30, r)

    def _fault_skew(self, rnd: Round, holder: str, epoch: int) -> None:
        skew = SKEW_MS if sum(1 for x in self.rounds if x.fault == "skew") % 2 == 1 else -SKEW_MS
        rnd.skew_ms = skew
        skewed = self.standbys()[0]
        rnd.notes.append(f"{skewed} {skew:+d} ms")
        self.replicas[skewed].stop()
        self.restart_replica(skewed, offset_ms=skew)
        fault_ms = now_ms()
        self.replicas[holder].signal(signal.SIGKILL)
        self.replicas[holder].proc.wait()
        name, new_epoch = self._takeover(rnd, fault_ms, epoch)
        self.restart_replica(holder)
        time.sleep(5.0)  # the new holder delivers (on its clock), the others follow its watermark
        fault_ms = now_ms()
        self.replicas[skewed].stop()  # graceful: a last watermark, the session closed at once
        if name == skewed:
            self._takeover(rnd, fault_ms, new_epoch, max(0, skew))
        self.restart_replica(skewed)

    def _fault_broker(self, rnd: Round, holder: str, epoch: int) -> None:
        self.mq.stop_broker(kill=True)
        down = time.monotonic()
        time.sleep(3.0)
        self.mq.start_broker()
        rnd.notes.append(f"broker down {time.monotonic() - down:.1f} s")
        time.sleep(5.0)  # retries after the broker came back

    def _fault_wipe(self, rnd: Round, holder: str, epoch: int) -> None:
        wiped = self.standbys()[-1]
        r = self.replicas[wiped]
        r.signal(signal.SIGKILL)
        r.proc.wait()
        shutil.rmtree(r.data_dir)
        restarted = now_ms()
        self.restart_replica(wiped)
        caught_up = restarted + LONGEST_DELAY_MS + 2_000
        time.sleep(max(0.0, (caught_up - now_ms()) / 1000))
        held = [e for e, (n, seen) in self.monitor.epochs.items() if n == wiped and seen >= restarted]
        if held:  # the holder ran all along: the wiped replica had no lease to take
            rnd.problems.append(f"the wiped replica {wiped} held the lease (epoch {held}) beside a live holder")
        rnd.notes.append(f"{wiped} wiped, standby {LONGEST_DELAY_MS / 1000 + 2:.0f} s")

    def _fault_wipe_takeover(self, rnd: Round, holder: str, epoch: int) -> None:
        wiped = self.standbys()[-1]
        r = self.replicas[wiped]
        r.signal(signal.SIGKILL)
        r.proc.wait()
        shutil.rmtree(r.data_dir)
        self.restart_replica(wiped)
        fault_ms = now_ms()
        self.replicas[holder].signal(signal.SIGKILL)
        self.replicas[holder].proc.wait()
        name, _ = self._takeover(rnd, fault_ms, epoch, max(0, self.offsets[holder]))
        rnd.notes.append(f"{wiped} wiped, then {name} took over")
        self.restart_replica(holder)
        time.sleep(LONGEST_DELAY_MS / 1000)  # what the wiped replica had to read again comes due

    def _fault_dupid(self, rnd: Round, holder: str, epoch: int) -> None:
        victim = holder if sum(1 for x in self.rounds if x.fault == "dupid") % 2 == 1 else self.standbys()[0]
        name = f"dup{next(self._starts)}"
        impostor = Replica(name, self.work, self.env, replica_id=victim,
                           TIMEWHEEL_HA_ZOOKEEPER=self.zk.connect_string)
        try:
            code: int | None = impostor.proc.wait(60)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            impostor.stop()
        rnd.notes.append(f"id {victim}: exit {code}")
        if code is None or code == 0:
            rnd.problems.append(f"a second process with replica_id {victim!r} was not refused (exit {code})")
        said = impostor.log.read_text()
        if "already live" not in said or "Traceback" in said:
            rnd.problems.append(f"the refused process did not say why in one line (it said: {said[-600:]!r})")
        after = self.monitor.holder()
        if after != (holder, epoch):
            rnd.problems.append(f"the lease moved from {holder} (epoch {epoch}) to {after} when a duplicate id started")

    def _zookeeper_down(self) -> tuple[int, int]:
        """Stop ZooKeeper for longer than the session: (when it stopped, the holder's last fencing deadline)."""
        fault_ms = now_ms()
        self.zk.stop()
        # the holder's connection drops at once, closing its fence; at the latest it may send until a
        # fencing period after its last confirmation, which came before the stop
        deadline = fault_ms + int(FENCE_FRACTION * SESSION_S * 1000) + PUBLISH_SLACK_MS
        time.sleep(max(0.0, (fault_ms + SESSION_S * 1000 + 2000 - now_ms()) / 1000))
        return fault_ms, deadline

    def _holders_now(self) -> list[tuple[str, int]]:
        """The live replicas that answer that they hold, with the epoch each names."""
        out = []
        for name, r in list(self.replicas.items()):
            try:
                doc = r.replica(timeout=2) if r.alive else {}
            except (OSError, ValueError):
                continue
            if doc.get("holder"):
                out.append((name, int(doc["epoch"])))
        return out

    def _all_ready(self, rnd: Round) -> None:
        for name in self.names:
            try:
                self.replicas[name].wait_ready(60)
            except AssertionError as e:
                rnd.problems.append(f"{name} is not ready after ZooKeeper came back: {str(e)[:600]}")

    def _fault_zookeeper_restart(self, rnd: Round, holder: str, epoch: int) -> None:
        fault_ms, deadline = self._zookeeper_down()
        back_ms = now_ms()
        rnd.silent.append((deadline, back_ms))
        self.zk.start()
        rnd.notes.append(f"ZooKeeper down {(back_ms - fault_ms) / 1000:.1f} s")
        wait_for("a replica holding again", lambda: self.monitor.holder_seen_ms > back_ms, 60)
        name, new_epoch = self.monitor.holder()
        smaller = [(n, e) for n, e in self._holders_now() if e < epoch - self.monitor.base]
        if smaller:
            rnd.problems.append(f"after ZooKeeper came back on its data, {smaller} held with an epoch below {epoch}")
        if new_epoch > epoch:
            fence_ms = int(FENCE_FRACTION * SESSION_S * 1000)
            rnd.failovers.append(Failover(fault_ms, self.monitor.epochs[new_epoch][1], epoch, new_epoch, fence_ms,
                                          healed_ms=back_ms, limit_s=ZK_RESTART_BOUND_S))
        else:
            rnd.notes.append(f"{name} kept epoch {epoch - self.monitor.base}")
        self._all_ready(rnd)

    def _fault_zookeeper_wipe(self, rnd: Round, holder: str, epoch: int) -> None:
        # the empty server refuses every client that saw a later transaction
        self._zookeeper_replaced(rnd, epoch, lambda: shutil.rmtree(self.zk.run_dir / "data"), "back empty",
                                 "ZooKeeperHistoryLostError")

    def _fault_zookeeper_ahead(self, rnd: Round, holder: str, epoch: int) -> None:
        other = LocalZooKeeper(self.work / f"zookeeper-other-{rnd.number}")
        with other:  # another ensemble: its own clients took it past every transaction this one had
            ahead = pump_transactions(other.connect_string, zookeeper_zxid(self.zk.connect_string) + AHEAD_BY)

        def replace() -> None:
            shutil.rmtree(self.zk.run_dir / "data")
            shutil.copytree(other.run_dir / "data", self.zk.run_dir / "data")

        # it takes the replicas back in new sessions, without the lease path each joined
        self._zookeeper_replaced(rnd, epoch, replace, f"back on another ensemble's data (at 0x{ahead:x})",
                                 "is gone or was created again")

    def _zookeeper_replaced(self, rnd: Round, epoch: int, replace: Callable[[], None], how: str, said: str) -> None:
        """ZooKeeper down past the session, its data replaced (`replace`), started again: each replica
        must exit with code 3 saying `said`, and is started again, as a supervisor does."""
        fault_ms, deadline = self._zookeeper_down()
        replace()
        base = self.monitor.new_era()  # every holder's fence closed long ago: none reports holding now
        back_ms = rnd.epoch_reset_ms = now_ms()
        self.zk.start()
        for name in self.names:
            r = self.replicas[name]
            try:
                wait_for(f"{name} exits, ZooKeeper having lost its history", lambda: not r.alive, 60, r)
            except AssertionError as e:
                rnd.problems.append(str(e)[:800])
                r.stop()
            tail = r.log.read_text()[-30_000:]
            if r.proc.returncode != 3 or said not in tail:
                rnd.problems.append(f"{name} exited with {r.proc.returncode} without saying that ZooKeeper lost "
                                    f"its history ({said!r}; its log ends {tail[-300:]!r})")
        restarted_ms = now_ms()
        rnd.silent.append((deadline, restarted_ms))
        for name in self.names:
            self.restart_replica(name)
        name, new_epoch, seen = self.monitor.wait_epoch_above(base, 60)
        rnd.notes.append(f"ZooKeeper down {(back_ms - fault_ms) / 1000:.1f} s, {how}; every replica exited "
                         f"and was started again; {name} holds epoch {new_epoch - base}")
        rnd.failovers.append(Failover(fault_ms, seen, epoch, new_epoch, int(FENCE_FRACTION * SESSION_S * 1000),
                                      healed_ms=back_ms, limit_s=ZK_WIPE_BOUND_S))
        self._all_ready(rnd)

    # ---- the end ------------------------------------------------------------------------------------

    def drain(self, timeout_s: float = 120.0) -> None:
        """Stop the workload and wait until everything it expects has arrived (or `timeout_s` after the last due)."""
        assert self.workload is not None and self.deliveries is not None
        self.workload.stop()
        sent = self.workload.snapshot()
        expected = {b for b, s in sent.items() if s.cancel_acked_ms is None and not s.cancel_unsure}
        last = max((s.effective_ms for s in sent.values()), default=now_ms())
        deadline = time.monotonic() + max(0.0, (last - now_ms()) / 1000) + timeout_s
        while time.monotonic() < deadline and not expected <= set(self.deliveries.snapshot()):
            time.sleep(0.5)
        time.sleep(3.0)  # a late duplicate shows up before counting

    def report(self) -> "Report":
        """The checker's verdict on what the target topic received (the delay topic read again from
        offset 0: how many delay messages hold each body)."""
        assert self.workload is not None and self.deliveries is not None
        produced: dict[bytes, set[str]] = {}
        for c in TopicReader(self.mq.namesrv_addr, self.delay_topic).read():
            produced.setdefault(c.body, set()).add(c.msg_id)
        return check(self.rounds, self.workload.snapshot(), self.deliveries.snapshot(), self.monitor.epochs,
                     self.workload.unacked, {b: len(ids) for b, ids in produced.items()})


def zookeeper_zxid(hosts: str) -> int:
    """The last transaction of the ZooKeeper at `hosts` (that of a write made to learn it)."""
    client = KazooClient(hosts=hosts, timeout=10)
    client.start(timeout=30)
    try:
        path = client.create("/nemesis-zxid-", ephemeral=True, sequence=True)
        stat = client.exists(path)
        assert stat is not None
        return int(stat.czxid)
    finally:
        client.stop()
        client.close()


def pump_transactions(hosts: str, past: int, batch: int = 2_000) -> int:
    """Write to the ZooKeeper at `hosts` (as another cluster's clients do) until its last transaction is
    past `past`; returns that transaction."""
    client = KazooClient(hosts=hosts, timeout=10)
    client.start(timeout=30)
    try:
        client.ensure_path("/other-cluster")
        stat = client.set("/other-cluster", b"")
        while stat.mzxid <= past:
            for f in [client.set_async("/other-cluster", b"") for _ in range(min(batch, past - stat.mzxid + 1))]:
                f.get(timeout=30)
            stat = client.set("/other-cluster", b"")
        return int(stat.mzxid)
    finally:
        client.stop()
        client.close()


def answers_as_standby(r: Replica) -> bool:
    """It answers, holding nothing (epoch 0): a standby."""
    try:
        doc = r.replica(timeout=1)
        return not doc["holder"] and doc["epoch"] == 0
    except (OSError, ValueError):
        return False


@dataclass
class Report:
    """The checker's findings: a table row per round and everything that broke a rule."""

    rows: list[Row]
    failures: list[str]
    totals: dict[str, int]
    #: each cancelled message seen delivered (failed or in a stated window), for whoever reads the run
    cancelled_delivered: list[str] = field(default_factory=list)

    def table(self) -> str:
        """The rounds as a Markdown table."""
        head = ("| round | fault | holder before -> after | takeover s | acked | delivered | lost | "
                "cancelled but delivered | duplicates (failover) | resent | bound |")
        lines = [head, "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in self.rows:
            lines.append(f"| {r.number} | {r.fault} | {r.holder_before} -> {r.holder_after} | {r.takeover_s} | "
                         f"{r.acked} | {r.delivered} | {r.lost} | {r.cancelled_delivered} | {r.duplicates} | "
                         f"{r.resent} | {r.bound} |")
        return "\n".join(lines)


def check(rounds: list[Round], sent: dict[bytes, Sent], copies: dict[bytes, list[Delivery]], epochs: dict[int, tuple[str, int]],
          unacked: int, produced: dict[bytes, int] | None = None) -> Report:
    """Compare what was acknowledged with what the target topic received, round by round.

    Copies are counted as the broker stored them (one the consumer received twice counts once).
    `produced`: per body, how many delay messages (distinct ids) the delay topic holds. A send the
    workload saw fail may have been stored all the same, and it sends the body again under a new id:
    each of those delay messages is delivered once, and only copies beyond them are sent again.
    Copies stored after a round's `epoch_reset_ms` (ZooKeeper back empty) have their epochs counted
    above every earlier one, as the monitor counts them.
    """
    failures: list[str] = []
    skew = max((abs(r.skew_ms) for r in rounds), default=0)
    resets = sorted(r.epoch_reset_ms for r in rounds if r.epoch_reset_ms)
    if resets:  # epochs from 1 again after each reset of ZooKeeper: told apart as the monitor does
        copies = {b: [dataclasses.replace(d, epoch=d.epoch + ERA * bisect.bisect_right(resets, d.store_ms))
                      if d.epoch > 0 else d for d in got] for b, got in copies.items()}

    def round_of(ms: int) -> Round | None:
        for r in reversed(rounds):
            if ms >= r.start_ms:
                return r
        return None

    failover_of = {f.new_epoch: (r, f) for r in rounds for f in r.failovers}
    first_epoch = min(epochs, default=0)
    for epoch, (holder, seen) in sorted(epochs.items()):
        if epoch != first_epoch and epoch not in failover_of:
            r = round_of(seen)
            f = Failover(seen, seen, 0, epoch, planned=False)
            if r is not None:
                r.failovers.append(f)
                r.notes.append(f"unplanned failover to {holder} (epoch {epoch})")
                failover_of[epoch] = (r, f)
    per: dict[int, dict[str, int]] = {r.number: dict(acked=0, delivered=0, lost=0, cancelled=0, dups=0, resent=0,
                                                      bound=0) for r in rounds}
    warm = dict(acked=0, delivered=0, lost=0, cancelled=0, dups=0, resent=0, bound=0)

    lost_examples: list[str] = []
    cancel_examples: list[str] = []
    for body, s in sent.items():
        r = round_of(s.effective_ms)
        bucket = per[r.number] if r is not None else warm
        got = copies.get(body, [])
        if s.cancel_acked_ms is not None:
            if got and s.cancel_acked_ms <= s.due_ms - 1_000 - skew:
                bucket["cancelled"] += 1
                cancel_examples.append(
                    f"cancelled but delivered: {body.decode()} id {s.msg_id} (sent {s.sent_ms}, due {s.due_ms}, "
                    f"cancel via {s.cancel_via} acknowledged {s.cancel_acked_ms}; copies "
                    + ", ".join(f"epoch {d.epoch} stored {d.store_ms}" for d in got) + ")")
            continue
        if s.cancel_unsure:
            continue
        bucket["acked"] += 1
        if got:
            bucket["delivered"] += 1
        else:
            bucket["lost"] += 1
            lost_examples.append(f"{body.decode()} (due {s.due_ms}, sent {s.sent_ms}, round {r.number if r else 0})")
        stored = set(got)
        extra = len(stored) - (produced or {}).get(body, 1)
        if extra > 0:
            e = max(d.epoch for d in stored)
            if len({d.epoch for d in stored}) > 1 and e in failover_of:
                per[failover_of[e][0].number]["dups"] += extra
                failover_of[e][1].dups += extra
            else:
                bucket["resent"] += extra
    # the bound of each failover: what was to go out from two watermark intervals (+0.5 s) before the
    # fault to the fault, or to the old holder's last possible send (fencing period, clock ahead)
    eff = sorted(s.effective_ms for s in sent.values())

    for r in rounds:
        for f in r.failovers:
            lo = f.fault_ms - 2 * int(WATERMARK_S * 1000) - PUBLISH_SLACK_MS
            hi = f.fault_ms + f.extra_ms
            bound = bisect.bisect_right(eff, hi) - bisect.bisect_right(eff, lo)
            f.bound = bound
            per[r.number]["bound"] += bound
            dups = f.dups
            if f.planned and f.takeover_s > f.limit_s:
                failures.append(f"round {r.number} ({r.fault}): takeover {f.takeover_s:.1f} s > {f.limit_s:g} s")
            if dups > bound:
                failures.append(f"round {r.number} ({r.fault}): {dups} duplicates at the failover to epoch "
                                f"{f.new_epoch}, above the bound {bound}")
        for epoch, after_ms in r.fenced:
            late = [d for got in copies.values() for d in got if d.epoch == epoch and d.store_ms > after_ms]
            # docs/HA.md: a pause between the fence's last look at the clock and the write sends the one
            # batch under the connection's lock on resuming
            if r.fault == "pause" and late and at_most_one_send_batch(late):
                r.notes.append(f"{len(late)} stored late in the batch in flight at the pause")
            elif late:
                beyond = ", more than one send batch" if r.fault == "pause" else ""
                failures.append(f"round {r.number} ({r.fault}): {len(late)} copies with the deposed epoch {epoch} "
                                f"stored after its deadline{beyond} ({stored_where(late)})")
        for lo, hi in r.silent:
            inside = [d for got in copies.values() for d in got if lo < d.store_ms < hi]
            if inside:
                failures.append(f"round {r.number} ({r.fault}): {len(inside)} copies stored while no replica could "
                                f"confirm a lease ({stored_where(inside)})")
        failures += [f"round {r.number} ({r.fault}): {p}" for p in r.problems]
    rows = []
    for r in rounds:
        p = per[r.number]
        takeovers = ", ".join(f"{f.takeover_s:.1f}" + ("" if f.planned else "?") for f in r.failovers) or "-"
        if p["lost"]:
            failures.append(f"round {r.number} ({r.fault}): {p['lost']} acknowledged messages never delivered")
        if p["cancelled"]:
            failures.append(f"round {r.number} ({r.fault}): {p['cancelled']} cancelled messages delivered")
        label = r.fault + (f" ({'; '.join(r.notes)})" if r.notes else "")
        rows.append(Row(r.number, label, r.holder_before, r.holder_after, takeovers, p["acked"], p["delivered"],
                        str(p["lost"]), str(p["cancelled"]), p["dups"], p["resent"],
                        str(p["bound"]) if r.failovers else "-"))
    if warm["lost"] or warm["cancelled"]:
        failures.append(f"before the first round: {warm['lost']} lost, {warm['cancelled']} cancelled delivered")
    if lost_examples:
        failures.append("lost, e.g. " + "; ".join(lost_examples[:5]))
    if cancel_examples and failures:
        failures.append("cancelled but delivered, e.g. " + "; ".join(cancel_examples[:5]))
    totals = dict(acked=sum(p["acked"] for p in per.values()) + warm["acked"],
                  lost=sum(p["lost"] for p in per.values()) + warm["lost"],
                  duplicates=sum(p["dups"] for p in per.values()),
                  resent=sum(p["resent"] for p in per.values()) + warm["resent"],
                  # of the workload's bodies (the admin API puts each cancel on every queue, under an id each)
                  resent_by_producer=sum(1 for b in sent if (produced or {}).get(b, 1) > 1),
                  cancels=sum(1 for s in sent.values() if s.cancel_acked_ms is not None),
                  cancelled_delivered=len(cancel_examples), unacked=unacked)
    return Report(rows, failures, totals, cancel_examples)


def run(rocketmq: LocalRocketMQ, zookeeper: LocalZooKeeper, work: Path, faults: list[str], *, replicas: int = 2,
        rate: float = 100.0, warm_up_s: float = 6.0, log: Callable[[str], None] = print) -> Report:
    """Run one round per fault in `faults` on a fresh shard and check the outcome."""
    cluster = Cluster(rocketmq, zookeeper, work, replicas=replicas, rate=rate)
    try:
        cluster.start()
        time.sleep(warm_up_s)
        for fault in faults:
            t = time.monotonic()
            rnd = cluster.run_round(fault)
            log(f"round {rnd.number} {fault}: {rnd.holder_before} -> {rnd.holder_after}, "
                f"{', '.join(f'takeover {f.takeover_s:.1f} s' for f in rnd.failovers) or 'no failover'}"
                f"{' (' + '; '.join(rnd.notes) + ')' if rnd.notes else ''}; {time.monotonic() - t:.0f} s")
        cluster.drain()
        return cluster.report()
    finally:
        cluster.stop()


def rounds_of(n: int, first: int = 0) -> list[str]:
    """`n` faults, every kind in turn."""
    return [FAULTS[(first + i) % len(FAULTS)] for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    """`python -m tests.coordination.nemesis`: see bench/nemesis.py."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=None,
                   help=f"rounds to run (default: one of each kind, {len(FAULTS)}; with --faults, one of each named)")
    p.add_argument("--faults", default="",
                   help=f"comma-separated, of {', '.join(FAULTS)}: these in turn instead of every kind")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--rate", type=float, default=100.0)
    p.add_argument("--work", type=Path, default=None)
    args = p.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.faults:
        kinds = args.faults.split(",")
        unknown = sorted(set(kinds) - set(FAULTS))
        if unknown:
            p.error(f"unknown faults {unknown}: choose from {', '.join(FAULTS)}")
        faults = [kinds[i % len(kinds)] for i in range(args.rounds or len(kinds))]
    else:
        faults = rounds_of(args.rounds or len(FAULTS))
    import os
    import tempfile

    started = time.monotonic()
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="nemesis-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        with LocalRocketMQ(stop_timeout=3.0) as mq, LocalZooKeeper() as zk:
            report = run(mq, zk, work, faults, replicas=args.replicas, rate=args.rate)
    print()
    print(report.table())
    print()
    print(json.dumps(report.totals))
    for line in report.cancelled_delivered:
        print(line)
    print(f"{len(faults)} rounds, {args.replicas} replicas, {args.rate:g} messages/s, "
          f"{time.monotonic() - started:.0f} s; load average at start {load[0]:.2f}, at end {os.getloadavg()[0]:.2f}")
    for f in report.failures:
        print("FAILED:", f)
    return 1 if report.failures else 0
