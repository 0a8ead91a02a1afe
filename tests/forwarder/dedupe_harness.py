"""The zero-duplicates fault harness: a real local RocketMQ with two brokers and a real ZooKeeper,
two groups of engines side by side, each with its own delay and target topics (queues on both
brokers) and a steady producer of short delays (1-3 s, so that there is always something in
flight), and one fault a round. Every fault goes through the engine's fault hook
(`rocketmq.fault_after_sends`): the engine signals itself right after the N-th send batch that was
written and answered, before its outcome is recorded, so that every round leaves copies on the
brokers that the engine's own records do not know of.

- `engine_kill`: the single engine (no [ha]), armed with SIGKILL after a random N, dies; it is
  started again on its data directory.
- `holder_kill`, `holder_pause`: in the replica set of two (tests/coordination/nemesis.py's
  `Cluster`), the standby is restarted armed and the holder hands the lease over to it (SIGTERM);
  the armed holder kills or stops itself (SIGKILL, SIGSTOP), the other takes over. A killed one is
  restarted as a standby; a paused one is continued once the new holder has taken over, and none of
  its copies (stamped with its epoch) may be stored after that.
- `broker_kill`, `broker_restart`: the single engine's hook kills it; right then one broker (each
  in turn) is killed with SIGKILL, or stopped gracefully, and started again; then the engine.

After each fault the harness reads the recovering engine's look-up counters from /status
(`dedupe`: found, missing = re-sent, unknown, resolve_ms_max), "-" when it has none. After the
last round the producers stop, everything due drains, and `dedupe_checker` reads both target
topics from offset 0 and counts the copies.
"""
from __future__ import annotations

import random
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from coordination import LocalZooKeeper
from forwarder._rmq_native import LogLevel, NativeProducer
from forwarder.local_rocketmq import LocalRocketMQ
from forwarder.rocketmq import OutgoingMessage, create_topics
from tests.coordination.cluster import Replica, Sent, Workload, now_ms, wait_for
from tests.coordination.nemesis import Cluster, answers_as_standby
from tests.forwarder.dedupe_checker import COUNTERS, Report, RoundRecord, StoredCopy, TopicReader, check
from tests.reliability.kill_loop import serve_env

FAULTS = ("engine_kill", "holder_kill", "holder_pause", "broker_kill", "broker_restart")
HOOK_TIMEOUT_S = 30.0  # an armed engine that has not fired by then is killed by the harness (noted)
RECOVERY_TIMEOUT_S = 25.0
#: the harness's brokers: commit-log files of 1 MiB (64 MiB by default in the launcher), so that a
#: broker fault can roll the log into a new file (`Harness._roll_commit_log`)
COMMIT_LOG_FILE_BYTES = 1 << 20
BROKER_OPTIONS: dict[str, str | int | bool] = {"mappedFileSizeCommitLog": COMMIT_LOG_FILE_BYTES}
FILL_TOPICS = ("ZERO_DUPS_FILL_A", "ZERO_DUPS_FILL_B")  # one on each broker only
FILL_BODY_BYTES = 16 << 10
#: how long a broker fault waits after the roll, the filler trickling: 5 s by default; past the
#: broker's checkpoint write (every 60 s, flushConsumeQueueThoroughInterval) for the index-unsafe control
CHECKPOINT_LAG_S = 5.0
CHECKPOINTED_S = 70.0


class ShortDelays(Workload):
    """The cluster's producer with every message due 1-3 s after it is sent, none cancelled."""

    def plan(self, i: int, now: int) -> tuple[int, bool]:
        """Due 1.0-3.0 s ahead."""
        return now + 1_000 + (i * 7919) % 2_000, False


def armed(after: int, sig: str) -> dict[str, str]:
    """The environment that arms an engine's fault hook."""
    return {"TIMEWHEEL_ROCKETMQ_FAULT_AFTER_SENDS": str(after), "TIMEWHEEL_ROCKETMQ_FAULT_SIGNAL": sig}


def dedupe_of(r: Replica) -> dict[str, int] | None:
    """The engine's look-up counters (None when its status has none, or it does not answer)."""
    try:
        d = r.status(timeout=2.0).get("dedupe")
    except (OSError, ValueError):
        return None
    if not isinstance(d, dict) or not d.get("enabled") or "found" not in d:
        return None
    return {k: int(d.get(k, 0)) for k in (*COUNTERS, "resolve_ms_max", "quiet_until_ms")}


def paused(r: Replica) -> bool:
    """The process is stopped (SIGSTOP): state T in /proc."""
    try:
        return Path(f"/proc/{r.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


class SingleEngine:
    """One engine without [ha] on a delay topic and target topic of its own, and their producer."""

    def __init__(self, mq: LocalRocketMQ, work: Path, env: dict[str, str], rate: float) -> None:
        """Prepare (start() starts)."""
        self.mq, self.work, self.rate = mq, work, rate
        self.run = uuid.uuid4().hex[:8]
        self.delay_topic, self.target = f"TW_DELAY_{self.run}", f"ZERO_DUPS_{self.run}"
        self.env = serve_env(mq, self.run, **env)
        self.engine: Replica | None = None
        self.workload: Workload | None = None
        self._starts = 0

    def start(self) -> "SingleEngine":
        """Topics (4 queues on each broker), the engine, the producer."""
        self.mq.create_topics([self.delay_topic, f"TW_DLQ_{self.run}", self.target], queues=4)
        self.launch().wait_ready()
        self.workload = ShortDelays(self.mq.namesrv_addr, self.delay_topic, self.target, self.run, self.rate).start()
        return self

    def launch(self, **extra: str) -> Replica:
        """Start the engine on its data directory (not waiting for it)."""
        self._starts += 1
        self.engine = Replica(f"e{self._starts}", self.work, self.env, data_dir=self.work / "engine", **extra)
        return self.engine

    def stop(self) -> None:
        """The producer, then the engine."""
        if self.workload is not None:
            self.workload.stop()
        if self.engine is not None:
            self.engine.stop()


class ReplicaSet(Cluster):
    """nemesis's shard of two replicas, with the short-delay producer and no consumer of its own."""

    def start(self) -> "ReplicaSet":
        """Topics, the first replica (it holds), the second, the monitor, the producer."""
        self.mq.create_topics([self.delay_topic, f"TW_DLQ_{self.run}", self.target], queues=4)
        first = self.start_replica(self.names[0])
        wait_for("the first replica holds the lease", first.holds, 30, first)
        for name in self.names[1:]:
            self.start_replica(name)
        self.monitor.start()
        wait_for("the monitor sees the holder", lambda: self.monitor.holder()[1] > 0, 10)
        self.workload = ShortDelays(self.mq.namesrv_addr, self.delay_topic, self.target, self.run, self.rate).start()
        return self


class Harness:
    """Both groups on one RocketMQ and one ZooKeeper, the rounds, the drain and the check."""

    def __init__(self, mq: LocalRocketMQ, zk: LocalZooKeeper, work: Path, *, dedupe: bool = True,
                 rate: float = 40.0, seed: int = 0, log: Callable[[str], None] = print,
                 checkpoint_wait_s: float = CHECKPOINT_LAG_S) -> None:
        """Prepare (start() starts); `checkpoint_wait_s`: a broker fault's wait after the roll."""
        self.checkpoint_wait_s = checkpoint_wait_s
        env = {"TIMEWHEEL_ROCKETMQ_DEDUPE": "true" if dedupe else "false",
               "TIMEWHEEL_ENGINE_RETRY_BASE_MS": "200", "TIMEWHEEL_ENGINE_MAX_ATTEMPTS": "1000"}
        self.mq, self.rng, self.log = mq, random.Random(seed), log
        self.single = SingleEngine(mq, work / "single", env, rate)
        self.ha = ReplicaSet(mq, zk, work / "ha", replicas=2, rate=rate)
        self.ha.env.update(env)
        self.rounds: list[RoundRecord] = []
        self._broker_turn = 0
        self._single_copies: TopicReader | None = None
        self._filler: NativeProducer | None = None
        #: what the brokers said of their index (`messageIndexSafe`), from the first engine status that tells
        self.index_settings: dict[str, Any] = {}

    def start(self) -> "Harness":
        """Both groups (engines and producers) and the filler producer of the broker faults."""
        for d in (self.single.work, self.ha.work):
            d.mkdir(parents=True, exist_ok=True)
        self.single.start()
        self._single_copies = TopicReader(self.mq.namesrv_addr, self.single.target)
        for topic, addr in zip(FILL_TOPICS, sorted(self.mq.broker_addrs.items())):
            create_topics(addr[1], [topic], 1)  # on that broker alone
        self._filler = NativeProducer(f"zero_dups_filler_{self.single.run}", self.mq.namesrv_addr,
                                      log_level=LogLevel.ERROR)
        self._filler.start()
        self.ha.start()
        return self

    def stop(self) -> None:
        """Everything this harness started (the brokers are left running)."""
        self.single.stop()
        self.ha.stop()
        if self._filler is not None:
            self._filler.shutdown()

    # ---- rounds ---------------------------------------------------------------------------------------

    def run_round(self, fault: str) -> RoundRecord:
        """One fault, the recovery, its counters."""
        rnd = RoundRecord(len(self.rounds) + 1, fault, now_ms())
        self.rounds.append(rnd)
        t = time.monotonic()
        if fault in ("holder_kill", "holder_pause"):
            self._holder_fault(rnd, "SIGKILL" if fault == "holder_kill" else "SIGSTOP")
        else:
            self._engine_fault(rnd, fault)
        rnd.end_ms = now_ms()
        d = rnd.dedupe
        self.log(f"round {rnd.number} {fault}: recovered by {rnd.recovered_by}"
                 + (f", takeover {rnd.takeover_s:.1f} s" if rnd.takeover_s is not None else "")
                 + (f", found {d['found']} re-sent {d['missing']} unknown {d['unknown']}" if d else ", no counters")
                 + (f" ({'; '.join(rnd.notes)})" if rnd.notes else "") + f"; {time.monotonic() - t:.0f} s")
        return rnd

    def _after(self) -> int:
        return self.rng.randint(1, 4)

    def _engine_fault(self, rnd: RoundRecord, fault: str) -> None:
        old = self.single.engine
        if old is not None:
            old.stop()  # graceful: everything it sent is recorded
        n = self._after()
        victim = self.single.launch(**armed(n, "SIGKILL"))
        rnd.notes.append(f"after {n} sends")
        self._await_hook(rnd, victim, lambda: not victim.alive)
        if fault.startswith("broker_"):
            i = self._broker_of_last_send()
            self._roll_commit_log(i)
            down = time.monotonic()
            if fault == "broker_kill":
                self.mq.stop_broker(kill=True, index=i)
            else:
                self.mq.stop_broker(timeout=60.0, index=i)
            self.mq.start_broker(index=i)
            rnd.notes.append(f"broker {'ab'[i]} down {time.monotonic() - down:.1f} s")
        engine = self.single.launch().wait_ready()
        rnd.recovered_by = engine.name
        self._read_recovery(rnd, engine, None)

    def _broker_of_last_send(self) -> int:
        """The broker that stored the single engine's latest copy (its ambiguous batch, as the engine
        died right after it); the brokers in turn if that cannot be told."""
        assert self._single_copies is not None
        new = self._single_copies.read()
        if new:
            name = max(new, key=lambda c: c.store_ms).where.split(":", 1)[0]
            return sorted(self.mq.broker_addrs).index(name)
        self._broker_turn += 1
        return self._broker_turn % len(self.mq.broker_addrs)

    def _roll_commit_log(self, index: int) -> None:
        """Fill broker `index`'s commit log into a new file, then wait out its checkpoint's lag: a
        broker's crash recovery reads (and indexes) its log again from the file its checkpoint names,
        so a rolled log is where index entries written before the roll depend on messageIndexSafe.
        Under real load the log rolls by itself; this harness's few messages a second would not. The
        broker writes its checkpoint every 60 s: only a wait past that (`checkpoint_wait_s`, the
        index-unsafe control's 70 s) makes the recovery start after the copies in question
        (`python -m bench.index_after_kill`, bench/RESULTS_ZERO_DUPS.md)."""
        assert self._filler is not None
        topic = FILL_TOPICS[index]
        for _ in range(COMMIT_LOG_FILE_BYTES // FILL_BODY_BYTES + 16):
            self._filler.send(OutgoingMessage(topic, b"f" * FILL_BODY_BYTES, None, None, {}))
        until = time.monotonic() + self.checkpoint_wait_s
        while time.monotonic() < until:  # a broker in use: its checkpoint moves past the roll
            self._filler.send(OutgoingMessage(topic, b"f" * 1024, None, None, {}))
            time.sleep(0.1)

    def _holder_fault(self, rnd: RoundRecord, sig: str) -> None:
        ha = self.ha
        holder, epoch = ha.monitor.holder()
        standby = next(n for n in ha.names if n != holder)
        n = self.rng.randint(3, 8)
        ha.replicas[standby].stop()
        ha.restart_replica(standby, extra=armed(n, sig))
        victim = ha.replicas[standby]
        rnd.notes.append(f"{standby} {sig} after {n} sends")
        # A replica contends only once it has read every queue to its end: stopped before then, the
        # holder, started again, could contend first and take the lease back (on a loaded machine,
        # 1 in 6 and 2 in 10 of these rounds did), and the armed one would never send.
        wait_for(f"{standby} eligible for the lease", lambda: eligible(victim), 60, victim)
        # a graceful hand-over to the armed replica, and the other back as a standby at once: the
        # armed one may fire within the first moments of its lease (what came due meanwhile)
        ha.replicas[holder].stop()
        ha.restart_replica(holder)
        before = dedupe_of(ha.replicas[holder])
        fault_ms = self._await_hook(rnd, victim, (lambda: not victim.alive) if sig == "SIGKILL" else
                                    (lambda: paused(victim)))
        handed = max((e for e, (name, _) in ha.monitor.epochs.items() if name == standby and e > epoch), default=0)
        if not handed:
            rnd.notes.append(f"{standby}'s lease not seen")
        new_epoch, seen = self._held_by(holder, max(epoch, handed))
        rnd.takeover_s = (seen - fault_ms) / 1000
        rnd.recovered_by = holder
        self._read_recovery(rnd, ha.replicas[holder], before)
        if sig == "SIGKILL":
            ha.restart_replica(standby)
        else:
            time.sleep(max(0.0, (fault_ms + 4_000 + 2_000 - now_ms()) / 1000))  # past its session
            victim.signal(signal.SIGCONT)
            rnd.fenced.append((handed or new_epoch - 1, now_ms()))
            wait_for(f"{standby} answers again, as a standby", lambda: answers_as_standby(victim), 30, victim)
            time.sleep(2.0)  # whatever it would still send lands before the next round

    def _held_by(self, name: str, above: int, timeout: float = 30.0) -> tuple[int, int]:
        """Wait until `name` holds with an epoch above `above`; (epoch, first seen ms)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            held = sorted((e, seen) for e, (n, seen) in list(self.ha.monitor.epochs.items()) if n == name and e > above)
            if held:
                return held[0]
            time.sleep(0.05)
        raise AssertionError(f"{name} did not take the lease over from epoch {above} within {timeout:.0f} s")

    def _await_hook(self, rnd: RoundRecord, victim: Replica, fired: Callable[[], bool]) -> int:
        deadline = time.monotonic() + HOOK_TIMEOUT_S
        while not fired():
            if time.monotonic() > deadline:
                rnd.problems.append(f"the fault hook of {victim.name} did not fire in {HOOK_TIMEOUT_S:.0f} s")
                victim.signal(signal.SIGKILL)
                victim.proc.wait()
                break
            if not victim.alive and victim.proc.returncode != -signal.SIGKILL:
                raise AssertionError(f"{victim.name} exited with {victim.proc.returncode}: "
                                     f"{victim.log.read_text()[-2000:]}")
            time.sleep(0.02)
        return now_ms()

    def _note_index_settings(self, engine: Replica) -> None:
        if not self.index_settings:
            try:
                brokers = (engine.status(timeout=2.0).get("dedupe") or {}).get("brokers")
            except (OSError, ValueError):
                return
            if isinstance(brokers, dict):
                self.index_settings = brokers

    def _read_recovery(self, rnd: RoundRecord, engine: Replica, before: dict[str, int] | None) -> None:
        """Wait for the engine's look-ups after the fault to settle; their counters over the round.

        Settled: past the quiet period (the look-ups begin after it), something looked up since
        `before`, and no counter moved for 1.5 s (6 s if nothing was looked up)."""
        deadline = time.monotonic() + RECOVERY_TIMEOUT_S
        base = before or {k: 0 for k in COUNTERS}
        last, stable_since = dedupe_of(engine), time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.25)
            now = dedupe_of(engine)
            if now != last:
                last, stable_since = now, time.monotonic()
            stable = time.monotonic() - stable_since
            if last is None:
                if stable > 4.0:
                    break  # no counters: the look-up is off, or not built
            elif now_ms() > last["quiet_until_ms"] + 500 and (
                    stable > 6.0 or (stable > 1.5 and last["looked_up"] > base["looked_up"])):
                break
        if last is None:
            return
        self._note_index_settings(engine)
        rnd.dedupe = {k: last[k] - base.get(k, 0) for k in COUNTERS}
        rnd.resolve_ms_max = last["resolve_ms_max"]
        if rnd.dedupe["episodes"] <= 0:
            rnd.notes.append("no look-up episode")

    # ---- the end --------------------------------------------------------------------------------------

    def sent(self) -> dict[bytes, Sent]:
        """What both producers had acknowledged."""
        assert self.single.workload is not None and self.ha.workload is not None
        return {**self.single.workload.snapshot(), **self.ha.workload.snapshot()}

    def drain_and_check(self, timeout_s: float = 90.0) -> Report:
        """Stop the producers, wait until every acknowledged message is stored (or the timeout), then
        read both target topics again from offset 0 with fresh readers and check."""
        assert self.single.workload is not None and self.ha.workload is not None
        self.single.workload.stop()
        self.ha.workload.stop()
        sent = self.sent()
        readers = [TopicReader(self.mq.namesrv_addr, t) for t in (self.single.target, self.ha.target)]
        seen: set[bytes] = set()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            seen |= {c.body for r in readers for c in r.read()}
            if sent.keys() <= seen:
                break
            time.sleep(1.0)
        time.sleep(3.0)  # a late copy shows up before counting
        fresh = [TopicReader(self.mq.namesrv_addr, t) for t in (self.single.target, self.ha.target)]
        copies: list[StoredCopy] = [c for r in fresh for c in r.read()]
        unacked = self.single.workload.unacked + self.ha.workload.unacked
        produced: dict[bytes, set[str]] = {}
        for topic in (self.single.delay_topic, self.ha.delay_topic):
            for c in TopicReader(self.mq.namesrv_addr, topic).read():
                produced.setdefault(c.body, set()).add(c.msg_id)
        report = check(self.rounds, sent, copies, unacked=unacked, problems=[p for r in fresh for p in r.problems],
                       produced={b: len(ids) for b, ids in produced.items()})
        report.totals["brokers_index"] = self.index_settings
        return report


def rounds_of(n: int, first: int = 0) -> list[str]:
    """`n` faults, every kind in turn."""
    return [FAULTS[(first + i) % len(FAULTS)] for i in range(n)]


def run(mq: LocalRocketMQ, zk: LocalZooKeeper, work: Path, faults: list[str], *, dedupe: bool = True,
        rate: float = 40.0, seed: int = 0, warm_up_s: float = 4.0, log: Callable[[str], None] = print,
        checkpoint_wait_s: float = CHECKPOINT_LAG_S) -> Report:
    """One round per fault in `faults`; the checker's report."""
    h = Harness(mq, zk, work, dedupe=dedupe, rate=rate, seed=seed, log=log, checkpoint_wait_s=checkpoint_wait_s)
    try:
        h.start()
        time.sleep(warm_up_s)
        for fault in faults:
            h.run_round(fault)
        return h.drain_and_check()
    finally:
        h.stop()


def report_json(report: Report, **config: Any) -> dict[str, Any]:
    """The report as one JSON document, with the run's configuration."""
    return {"config": config, "totals": report.totals, "rounds": report.rows, "failures": report.failures}


def eligible(r: Replica) -> bool:
    """It answers, and may contend for the lease (it has read every queue of its shard to the end)."""
    try:
        return r.replica(timeout=1).get("eligible") is True
    except (OSError, ValueError):
        return False
