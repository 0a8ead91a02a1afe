"""The long-running service: the engine fed by the delay topic and delivering to RocketMQ.

This is the composition root: the only module of `timewheel` that reaches into `forwarder`, and
only through `forwarder.connect_rocketmq`, which hands back a Source and a Sink, and
`forwarder.shaping_control.ShapingControl`, which owns the engine's Shaper and its rules (config
file watched, admin API, persisted in the meta store; precedence in that module).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from storage import StorageError
from timewheel.app._stop_steps import StopSteps
from timewheel.app._start_checks import (StartError, check_zookeeper_reachable, claim_data_dir as _claim_data_dir,
                                         undo_failed_start)
from timewheel.app._write_gate import WriteGate
from timewheel.app.admin import AdminServer
from timewheel.app.datadir import os_error_at_start
from timewheel.app.gc_pauses import GcPauses, freeze_started_heap
from timewheel.app.lateness_window import LatenessWindow
from timewheel.app.runtime import log_hot_paths, name_os_threads
from timewheel.app.readiness import must_stop, not_ready_why
from timewheel.clock import Clock, SystemClock
from timewheel.engine import Engine
from timewheel.message import DeadLetterSink, RecordSink, ScheduleFn
from timewheel.errors import ConfigError, EngineStateError
from timewheel.app.metrics import service_registry
from timewheel.app.settings import Settings

if TYPE_CHECKING:
    from timewheel.app.cancel import CancelAnswer
    from coordination import ShardReplica
    from forwarder import RocketMQConfig, RocketMQEndpoints
    from forwarder.shaping_control import ShapingControl
    from forwarder.trace import TraceWriter
    from forwarder.copy_finder import BrokerCopyFinder
    from forwarder.clock_check import ClockGuard

log = logging.getLogger("timewheel.app.service")


class Service:
    """An engine, its delay-topic ingest and its RocketMQ delivery, started and stopped together."""

    def __init__(self, settings: Settings, clock: Clock | None = None, *, admin: bool = True,
                 config_path: Path | None = None) -> None:
        """`config_path`: the TOML file the settings came from; its `[shaping]` section is watched."""
        self.settings = settings
        self.config_path = config_path
        self.shaping: ShapingControl | None = None
        # engine.clock_offset_ms skews this engine's time on purpose (fault drills); 0 otherwise
        self.clock = clock or SystemClock(settings.engine.clock_offset_ms)
        self.engine: Engine | None = None
        self.admin: AdminServer | None = None
        self._endpoints: RocketMQEndpoints | None = None
        self.replica: ShardReplica | None = None  # with [ha]: this engine's lease on its shard
        self._rmq: RocketMQConfig = settings.rocketmq  # with [ha], under the replica's own consumer group
        self._stop = threading.Event()
        self._stop_sampling = threading.Event()
        self._sampler: threading.Thread | None = None
        self.lateness_window: LatenessWindow | None = None
        self._window_lock = threading.Lock()  # the sampler thread writes what status requests read
        self._consuming = False
        # admin-API requests that use the engine (cancels, traffic rules, look-ups): none once `stop()`
        # has begun, and it waits for those under way, so that none meets an engine or a producer
        # being closed halfway
        self._writes = WriteGate()
        self._want_admin = admin
        self.trace: TraceWriter | None = None
        self.copy_finder: BrokerCopyFinder | None = None
        self.clock_guard: ClockGuard | None = None  # holds every send while this host's clock runs far ahead
        self.hot_paths: dict[str, bool] = {}  # which hot loops run compiled (set at start)
        self.gc_pauses = GcPauses()  # timed while started

    def start(self) -> "Service":
        """Open the store, connect to RocketMQ, start delivering, then start consuming. A start that fails
        at any step stops what it started (as `stop()` does) and raises that step's error as it was."""
        self._writes.reopen()
        try:
            return self._start()
        except BaseException:
            # an engine left running behind the error would go on sending with nobody to stop it
            undo_failed_start(self.stop)
            raise

    def _start(self) -> "Service":
        from forwarder import ContractLimits, connect_rocketmq
        from forwarder.shaping_control import ShapingControl

        from timewheel.app._http import HttpStartError, raise_open_files_limit

        # part files, the meta store and connections all take descriptors: the soft limit (often
        # 1024) is raised to what the hard limit allows, and the admin port keeps to a quarter of it
        raise_open_files_limit()
        self.hot_paths = log_hot_paths()
        self.gc_pauses.install()
        cfg = self.settings.engine
        # invalid traffic rules stop the start here, before anything connects
        shaping = ShapingControl(self.settings.shaping, config_path=self.config_path, max_grant=cfg.send_batch_size,
                                 now_ms=self.clock.now_ms)
        rmq = self.settings.rocketmq
        limits = ContractLimits(cfg.max_delay_ms, cfg.max_body_bytes, frozenset({rmq.delay_topic, rmq.dead_letter_topic}))
        ha = self.settings.ha
        replica_dir = None
        if ha.enabled:  # before anything connects: an unreachable ZooKeeper is said at once, not after 30 s
            check_zookeeper_reachable(ha.zookeeper)
            replica_dir = _claim_data_dir(cfg.data_dir, ha, rmq.delay_topic)
        if ha.enabled:  # one replica of a shard: its queues only, under a group of its own
            rmq = self._rmq = dataclasses.replace(rmq, consumer_group=ha.consumer_group(rmq.consumer_group))
        self._endpoints = connect_rocketmq(rmq, limits, self.clock.now_ms,
                                           queue_ids=ha.owns_queue if ha.enabled else None)
        sink = self._endpoints.sink
        delivery: RecordSink = sink
        dead_letters: DeadLetterSink = sink
        if rmq.fault_after_sends:  # the fault harness's crash between a send and its record
            from forwarder.faults import SignalAfterSends

            log.warning("fault injection is on: %s after %d send batches (rocketmq.fault_after_sends)",
                        rmq.fault_signal, rmq.fault_after_sends)
            delivery = SignalAfterSends(sink, rmq.fault_after_sends, signal.Signals[rmq.fault_signal])
        if rmq.trace:  # RocketMQ's message trace of the engine's two hops (forwarder.trace)
            from forwarder.trace import TraceWriter, TracingSink

            self.trace = TraceWriter(self._endpoints.dead_letters, rmq.trace_topic, rmq.consumer_group,
                                     rmq.producer_group).start()
            delivery = TracingSink(delivery, self.trace, self.clock.now_ms)
        if rmq.max_clock_ahead_ms:  # measured before the first send: a host clock far ahead would send early
            from forwarder.clock_check import ClockGuard
            delivery = self.clock_guard = ClockGuard.started(delivery, rmq, self.clock.now_ms)
        if ha.enabled:
            from coordination import CoordinationError, EpochStampingSink, FencedDeadLetters, FencedSink, ShardReplica
            from coordination.identity import Eligibility
            from coordination.watermark import MAX_EXCEPTIONS

            self.replica = ShardReplica(ha, rmq.delay_topic, now_ms=self.clock.now_ms, namesrv=rmq.namesrv)
            # the fence decided in one place: before each batch and at the write; dead letters too
            delivery = FencedSink(EpochStampingSink(delivery, self.replica), self.replica.may_send)
            dead_letters = FencedDeadLetters(sink, self.replica.may_send)
        if rmq.dedupe:  # look up what a crash or takeover left ambiguous before sending it again
            from forwarder.copy_finder import BrokerCopyFinder

            self.copy_finder = BrokerCopyFinder(rmq, self.clock.now_ms, data_dir=cfg.data_dir, delivery=sink)
        # the shaper grants nothing until the rules in force are settled from the meta store
        try:
            self.engine = Engine(cfg, delivery, self.clock, dead_letter_sink=dead_letters, shaper=shaping.shaper,
                                 gate=self.replica, copy_finder=self.copy_finder).start()
        except (StorageError, OSError) as e:  # in use by another engine, another format, unreadable: one line
            raise StartError(str(e) if isinstance(e, StorageError) else os_error_at_start(e, cfg.data_dir)) from e
        assert self.engine.store is not None
        if self.replica is not None and replica_dir is not None:
            source = self._endpoints.source  # the directory's own offsets, not the group's; eligible once caught up
            source.start_offsets = dict(replica_dir.offsets)
            self.replica.eligibility = Eligibility(replica_dir, source.catch_up, source.stored_offsets,
                                                   force=ha.force_eligible)
            if self.copy_finder is not None:  # a standby learns the brokers the holder's copies went to (docs/HA.md)
                self.replica.share_brokers(self.copy_finder.served)
            try:
                engine = self.engine  # up to MAX_EXCEPTIONS retrying entries are listed, not waited for
                self.replica.start(lambda: engine.delivered_up_to_except(MAX_EXCEPTIONS),
                                   offsets_source=self._endpoints.source.stored_offsets)
            except (ConnectionError, CoordinationError) as e:
                # refused: the engine (and its store) stops cleanly and the command says why in one line
                raise StartError(str(e)) from e
        self.shaping = shaping  # before its start: a start that fails halfway leaves its watch thread to stop
        shaping.start(self.engine.store.meta)
        schedule: ScheduleFn = self.engine.schedule
        if self.trace is not None:
            from forwarder.trace import traced_schedule

            schedule = traced_schedule(schedule, self.trace, self.clock.now_ms)
        # without a trace, pull answers are read in one pass and stored as record bytes (a trace
        # records each message as scheduled, so it takes them as messages)
        from forwarder import RemotingError

        if self._want_admin:  # its port is taken before consuming: one in use stops the start with nothing consumed
            self.admin = self._bind_admin(self.engine)
        try:
            self._endpoints.source.start(schedule, self.engine.apply_cancels,
                                         encoded=self.engine if self.trace is None else None)
        except RemotingError as e:  # no NameServer, no route, refused: the command says why in one line
            raise StartError(f"cannot start consuming {rmq.delay_topic} through the NameServer at {rmq.namesrv}: {e}. "
                             "Start RocketMQ (`timewheel broker` runs a local one) or fix rocketmq.namesrv; the "
                             "engine stopped cleanly and consumed nothing") from e
        self._consuming = True
        self._start_sampling(self.engine)
        if self.admin is not None:
            try:
                self.admin.start()
            except HttpStartError as e:  # the engine stops with the start: the command says why in one line
                raise StartError(f"cannot serve the admin endpoint on admin.listen = {self.settings.admin.listen!r}: "
                                 f"{e}; the engine stopped cleanly") from e
        log.info("serving: delay topic %s on %s, data in %s", self.settings.rocketmq.delay_topic,
                 self.settings.rocketmq.namesrv, cfg.data_dir)
        return self

    def _bind_admin(self, engine: Engine) -> AdminServer:
        """The admin endpoint, listening but not serving yet; StartError if it cannot listen."""
        registry = service_registry(engine.stats, lambda: engine.lateness_buckets, self.endpoint_stats, self.gc_pauses)
        listen = self.settings.admin.listen
        try:
            return AdminServer(listen, self.settings.admin.token, self, registry)
        except OSError as e:  # a port another process holds (another engine on this host), an address not this host's
            raise StartError(f"cannot serve the admin endpoint on admin.listen = {listen!r}: {e.strerror or e}. Give "
                             "this engine an address of its own (--admin HOST:PORT) or stop what holds it; the engine "
                             "stopped cleanly and consumed nothing") from e

    def stop(self) -> None:
        """Stop taking messages, finish in-flight sends, checkpoint and close. Every step runs even when
        one before it failed (a replica that could not hand its lease on still closes the store); the
        first failure is raised once all have run, the others logged."""
        self._writes.close(timeout=30.0)  # a cancel or rule change under way finishes first; later ones get 503
        self._consuming = False
        self._stop_sampling.set()
        steps = StopSteps()
        sampler, self._sampler = self._sampler, None
        with steps("the sampler"):
            if sampler is not None:
                sampler.join()
        with steps("the traffic rules' watcher"):
            if self.shaping is not None:
                self.shaping.stop()
        replica, self.replica = self.replica, None
        with steps("the replica"):  # stop sending, publish the last watermark, hand the lease on
            if replica is not None:
                replica.stop()
        with steps("consuming the delay topic"):
            if self._endpoints is not None:
                self._endpoints.source.stop()
        engine, self.engine = self.engine, None
        with steps("the engine"):
            if engine is not None:
                engine.stop()
        finder, self.copy_finder = self.copy_finder, None
        with steps("the copy finder"):
            if finder is not None:
                finder.close()
        guard, self.clock_guard = self.clock_guard, None
        with steps("the clock check"):
            if guard is not None:
                guard.close()
        trace, self.trace = self.trace, None
        with steps("the trace"):  # what was traced is sent before its producer closes
            if trace is not None:
                trace.stop()
        endpoints, self._endpoints = self._endpoints, None
        with steps("the RocketMQ connections"):
            if endpoints is not None:
                endpoints.close()  # the source is stopped already; this closes the senders
        admin, self.admin = self.admin, None
        with steps("the admin endpoint"):
            if admin is not None:
                admin.stop()
        with steps("the GC pause watch"):
            self.gc_pauses.remove()
        steps.raise_first()

    # ---- what the admin endpoint drives ----------------------------------------------------------

    def ready(self) -> bool:
        """Whether the engine runs, all its threads alive, its checkpoints succeed, and the delay topic
        is being consumed (`not_ready_why` says what is not)."""
        return not self.not_ready_why()

    def not_ready_why(self) -> list[str]:
        """Why the service is not ready, a line an operator can act on each (none: ready)."""
        return not_ready_why(self.engine, self._consuming, self.dead_threads(), self.thread_failures(), self.replica,
                             self.clock_guard)

    def dead_threads(self) -> list[str]:
        """The threads this service relies on that ended while it runs: the engine's, the delay topic
        consumer's, and with [ha] the replica's (whose death must hand the lease on)."""
        return [*(self.engine.dead_threads() if self.engine is not None else []),
                *(self._endpoints.source.dead_threads() if self._endpoints is not None else []),
                *(self.replica.dead_threads() if self.replica is not None else [])]

    def thread_failures(self) -> dict[str, str]:
        """Of the threads `dead_threads` names, the error that ended each (`Type: message`)."""
        return {**(self.engine.thread_failures() if self.engine is not None else {}),
                **(self._endpoints.source.thread_failures() if self._endpoints is not None else {}),
                **(self.replica.thread_failures() if self.replica is not None else {})}

    def cancel(self, msg_id: str | None, key: str | None) -> CancelAnswer:
        """Cancel by id or business key on every engine of the delay topic (`timewheel.app.cancel`); the
        answer says whether it was applied by the replica that sends (`applied_on`, `promise`)."""
        from timewheel.app.cancel import CancelAnswer, cancel_everywhere

        # never an answer of 0 when not running: that reads as "done, nothing matched", and the cancel is lost
        refused = ("this engine is not running (starting or stopping): the cancel was neither applied nor put on "
                   "the delay topic; send it again once it is ready, or to another engine of the delay topic")
        with self._writes.enter(refused):
            replica, engine, endpoints = self.replica, self.engine, self._endpoints
            if engine is None or endpoints is None:
                raise EngineStateError(refused)
            n = cancel_everywhere(engine, endpoints, msg_id, key, self.clock.now_ms())
        if not self.settings.ha.enabled:
            return CancelAnswer(n, "engine")
        # without a lease object this replica sends nothing: it promises nothing either
        return CancelAnswer(n, "holder" if replica is not None and replica.epoch else "standby")

    def find_messages(self, msg_id: str | None, key: str | None, limit: int) -> dict[str, Any]:
        """Stored messages with an id or a business key and their timelines (`timewheel.find`)."""
        from timewheel.find import MessageFinder

        # through the gate: a stop waits for a look-up under way before it closes the meta store it reads
        with self._writes.enter("the service is stopping: look the message up again once it runs, or with "
                                "`timewheel find --data-dir` beside it"):
            engine = self.engine
            if engine is None or engine.store is None:
                raise ConfigError("the service is not running: there is no data directory to look in")
            with MessageFinder(engine.store.layout, engine.store.meta) as finder:
                now = self.clock.now_ms()
                found = finder.by_id(msg_id, now, limit) if msg_id is not None else finder.by_key(key or "", now, limit)
        return found.to_dict()

    def shaping_rules(self) -> dict[str, Any]:
        """The traffic rules in force."""
        return self.shaping.rules if self.shaping is not None else dict(self.settings.shaping)

    def replace_shaping_rules(self, rules: dict[str, Any]) -> dict[str, Any]:
        """Replace the traffic rules (validated whole; refused rules leave the old ones in force)."""
        refused = ("the service is not running (starting or stopping): the traffic rules were not changed; send "
                   "them again once it is ready")
        with self._writes.enter(refused):
            if self.shaping is None or self.engine is None:
                raise EngineStateError(refused)
            return self.shaping.replace(rules)

    def _start_sampling(self, engine: Engine) -> None:
        """Snapshot the lateness buckets every second, for the last-minute window of `status`."""
        window = self.lateness_window = LatenessWindow(engine.lateness_buckets.bounds_ms)
        window.sample(self.clock.now_ms(), engine.lateness_buckets.counts.copy())
        self._stop_sampling.clear()

        def loop() -> None:
            name_os_threads()
            while not self._stop_sampling.wait(1.0):
                with self._window_lock:
                    window.sample(self.clock.now_ms(), engine.lateness_buckets.counts.copy())
                name_os_threads()  # pull threads come and go with the queues this engine owns

        self._sampler = threading.Thread(target=loop, name="timewheel-lateness-window", daemon=True)
        self._sampler.start()

    def status(self) -> dict[str, Any]:
        """One screen for whoever is on call: ingest lag, pending, retries, last-minute lateness, shaping."""
        from timewheel.app.ingest_lag import IngestLagError, ingest_lag
        from timewheel.app.status import dedupe_status, status_document

        now = self.clock.now_ms()
        lag, lag_error = None, None
        if self._endpoints is not None:
            try:
                lag = ingest_lag(self._rmq)
                if self.settings.ha.enabled:  # a replica's group reads its shard's queues only
                    lag = [q for q in lag if self.settings.ha.owns_queue(q.queue)]
            except IngestLagError as e:
                lag_error = str(e)
        late, span, count = [0.0, 0.0], 0, 0
        engine, window = self.engine, self.lateness_window
        if engine is not None and window is not None:
            with self._window_lock:
                counts, span = window.recent(now, engine.lateness_buckets.counts.copy())
            late, count = window.percentiles(counts, (50, 99)), int(counts.sum())
        why = self.not_ready_why()
        doc = status_document(self.stats(), serving=not why, not_serving_why=why, now_ms=now, lag=lag, lag_error=lag_error,
                              lateness_ms=late, lateness_count=count, lateness_span_ms=span)
        if self.replica is not None:
            doc["ha"] = self.replica.status_document()
        doc["dedupe"] = dedupe_status(self.copy_finder, engine.recovery if engine is not None else None)
        doc["hot_paths"] = dict(self.hot_paths)
        return doc

    def endpoint_stats(self) -> dict[str, object]:
        """RocketMQ counters: `ingest` (the delay topic's consumer), `delivery` (the sink), `circuit_open`,
        `serving` (what /readyz answers); with [ha], `ha` (the replica's counters) and `ha_holder`; with trace, `trace`."""
        if self._endpoints is None:
            return {}
        out: dict[str, object] = {"ingest": self._endpoints.source.counter_values(),
                                  "delivery": dict(self._endpoints.sink.counters),
                                  "circuit_open": self._endpoints.sink.breaker.is_open, "serving": self.ready()}
        if self.replica is not None:  # with [ha]: the replica's counters and whether it holds the lease
            out["ha"] = self.replica.counter_values()
            out["ha_holder"] = self.replica.may_send()
        if self.trace is not None:  # with [rocketmq] trace: records written, sent, dropped, failed
            out["trace"] = self.trace.counter_values()
        if self.clock_guard is not None:  # the host's clock against the brokers' (sends held while far ahead)
            out["broker_clock"] = self.clock_guard.status()
        recovery = self.engine.recovery if self.engine is not None else None
        if self.copy_finder is not None and recovery is not None:  # the look-ups before sending again
            snap = recovery.snapshot()
            out["dedupe"] = {**{k: snap[k] for k in ("episodes", "looked_up", "found", "missing", "unknown")},
                             "barriers": self.copy_finder.counters["barriers"]}
        return out

    def stats(self) -> dict[str, object]:
        """Engine and RocketMQ counters, as JSON-ready dicts (`EngineStats.as_dict()` and `endpoint_stats()`)."""
        engine = self.engine.stats() if self.engine else None
        out = engine.as_dict() if engine is not None else {}
        out.update(self.endpoint_stats())
        if self.shaping is not None and engine is not None and engine.shaping is not None:
            out["shaping"] = {**engine.shaping, "rules": self.shaping.status()}
        return out

    def run_until_signalled(self) -> None:
        """Serve until SIGTERM or SIGINT, then stop gracefully; a second signal exits at once."""
        def on_signal(signum: int, frame: FrameType | None) -> None:
            if self._stop.is_set():
                # Every acknowledged message is already in the store (the same guarantee as a
                # kill -9), so leaving without the graceful steps loses nothing.
                log.warning("second signal: exiting now (acknowledged messages are already stored)")
                logging.shutdown()
                os._exit(1)
            log.info("signal %s: stopping gracefully", signal.Signals(signum).name)
            self._stop.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        self.start()
        # This process serves and nothing else: what the start made stays, and full collections need
        # not walk it again and again (each one stops every engine thread; `timewheel.app.gc_pauses`).
        frozen = self.gc_pauses.frozen = freeze_started_heap()
        self.gc_pauses.reset()  # what the metrics show is the serving's, not the start's own full collection
        log.info("%d objects of the start frozen out of the garbage collector's full passes", frozen)
        failed = False
        try:
            while not self._stop.wait(0.5):
                store = self.engine.store if self.engine is not None else None
                reason = must_stop(self.dead_threads(), store.checkpoints_stopped if store is not None else None)
                if reason is not None:
                    log.critical("%s", reason)
                    failed = True
                    break
        finally:
            try:
                self.stop()
            except Exception:
                log.critical("the stop did not finish cleanly (the error follows); what the last checkpoint did not "
                             "make durable is replayed from the ingest log at the next start", exc_info=True)
                failed = True
        # Everything is stored, recorded and closed. Leave without running the RocketMQ client
        # library's static destructors, which can abort while its threads wind down.
        logging.shutdown()
        os._exit(3 if failed else 0)
