"""One replica of one shard: contends for the shard's lease, gates its engine, publishes or follows the watermark.

Every replica of a shard consumes the shard's queues into its own data directory; only the holder of the
shard's lease sends. The lease is ZooKeeper's classic election: each replica creates an ephemeral sequential
znode `<shard>/lease/replica-<seq>`, and the lowest live one holds the lease. Its sequence number (plus one,
so that 0 means none) is the lease's epoch: ZooKeeper numbers children in creation order, and the lowest live
node's number only grows as holders die, so every new holder has a larger epoch than the last. The node
vanishes when its session ends (the process died, or was silent for longer than the session timeout), and
the next replica holds the lease.

The holder (`ShardReplica`, a `timewheel.gate.DeliveryGate` for its engine)
- confirms its node every sixth of the session timeout (and with each watermark), which extends
  its fencing deadline (`coordination.fencing`); its engine sends only before that deadline;
- publishes its engine's delivered-up-to watermark every `watermark_interval_s` (`coordination.watermark`);
- stamps every message it sends with the epoch (`EpochStampingSink`, property `TW_LEASE_EPOCH`);
- publishes the brokers its data directory saw serve each target topic (`share_brokers`,
  `coordination._shared_brokers`), and sends nothing from the moment it learns one until it has
  (giving the lease up when that lasts `dedupe_brokers_publish_timeout_s`).

A replica that does not hold the lease follows the published watermark: its engine records what is due up to
it as delivered elsewhere and holds the rest; the holder's brokers join its data directory's, for its look-ups
after a takeover. When it becomes the holder it reads both once more, and its engine sends everything due
after the watermark, overdue messages first; what was due between that watermark and the takeover may have
been sent by the previous holder too (counted as `possible_duplicates`: those due by the time its next
watermark was due).

Cancels need no lease: each replica's own ingest stores what the delay topic carries (control messages
included), so a cancel sent on the delay topic reaches every replica.
"""
from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Callable, Sequence

import numpy as np
from kazoo.exceptions import KazooException
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.protocol.states import EventType, KazooState, WatchedEvent

from coordination._failing_rounds import ZOOKEEPER_ERRORS, FailingRounds
from coordination._history import LostHistoryWatch, end_session, replica_client
from coordination._session_grant import granted_session_timeout_s
from coordination._shared_brokers import RememberedBrokers, SharedBrokers
from coordination._succession import Succession, fence_advert
from coordination.errors import LeasePathDeletedError, ZooKeeperJoinError, ZooKeeperUnreachableError
from coordination.config import HAConfig
from coordination.fencing import FencingDeadline
from coordination.identity import Eligibility
from coordination.lease import ReplicaCounters, ReplicaIdTaken, claim_replica_id, epoch_of, lease_sequence, our_node
from coordination.members import Membership
from coordination.watermark import (MalformedWatermark, Watermark, covered_by, engine_mark, publish_watermark,
                                    read_watermark)
from timewheel.gate import NO_WATERMARK, DeliveredMark
from timewheel.message import Message

__all__ = ["ReplicaCounters", "ReplicaIdTaken", "ShardReplica", "epoch_of", "lease_sequence"]

log = logging.getLogger("timewheel.replica")

_PREFIX = "replica-"
#: epochs whose last watermark a replica keeps
_EPOCHS_KEPT = 8


class ShardReplica:
    """The lease, fence and watermark of one replica of one shard; the delivery gate of its engine."""

    def __init__(self, cfg: HAConfig, delay_topic: str, *, now_ms: Callable[[], int],
                 monotonic: Callable[[], float] = time.monotonic, namesrv: str = "") -> None:
        """`namesrv`: the NameServer list the delay topic is read from (`coordination.members`; "": unknown)."""
        self.cfg = cfg
        self.delay_topic = delay_topic
        self.path = cfg.shard_path(delay_topic)
        self.hold_ms = cfg.hold_ms
        self.fence = FencingDeadline(cfg.session_timeout_s, cfg.fence_fraction, monotonic)
        self.counters = ReplicaCounters()
        self.zookeeper_rounds = FailingRounds(cfg.zookeeper, cfg.replica_id, self.path, self.fence, now_ms, monotonic)
        self._members = Membership(cfg, delay_topic, namesrv)
        self._now_ms = now_ms
        self._monotonic = monotonic
        self._lock = threading.Lock()  # the fields below, read by dispatch threads
        self._active = False
        self._epoch = 0
        self._peer_watermark = NO_WATERMARK
        #: the last watermark of each epoch seen (the current holder's, and those before it): a record
        #: one of them covers was delivered by that holder
        self._marks: dict[int, Watermark] = {}
        self._ahead_reported = NO_WATERMARK  # the last peer watermark found ahead of our clock (reported once)
        self._took_over_ms = 0
        self._duplicates_until = NO_WATERMARK
        self._published = Watermark()
        self._node: str | None = None  # our contender znode's name
        self._session: int | None = None  # the session that owns it
        self._wake = threading.Event()
        self._node_prefix = f"{_PREFIX}{uuid.uuid4().hex[:12]}-"  # protected lease nodes: ours by name
        # a holder's node deleted by hand leaves its fence open: the next one waits it out (coordination._succession)
        self._succession = Succession(self.path, cfg.replica_id, cfg.fence_fraction * cfg.session_timeout_s, monotonic)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._failure: str | None = None  # the error that ended the replica thread
        self._watermark_source: Callable[[], int | DeliveredMark] | None = None
        self._offsets_source: Callable[[], dict[str, int]] | None = None
        #: whether this replica may contend (its data directory caught up, no gap); None: always
        self.eligibility: Eligibility | None = None
        self._brokers: SharedBrokers | None = None  # the brokers its copies went to, shared with the other replicas
        self._client = replica_client(cfg.zookeeper, cfg.session_timeout_s)
        self._history = LostHistoryWatch(cfg.zookeeper, cfg.session_timeout_s, monotonic)
        self._client.add_listener(self._on_state)

    # ---- the delivery gate --------------------------------------------------------------------------

    def may_send(self) -> bool:
        """True while this replica holds the lease, its fencing deadline has not passed and every broker
        its data directory learnt is published (a successor knows where its copies went)."""
        return self._active and self.fence.may_send() and (self._brokers is None or self._brokers.settled())

    def share_brokers(self, remembered: RememberedBrokers) -> None:
        """Before `start`: publish the brokers `remembered` (the data directory's) while holding, add the
        holder's to them otherwise (`coordination._shared_brokers`)."""
        self._brokers = SharedBrokers(remembered, self.path, self.cfg.replica_id, self._wake.set,
                                      monotonic=self._monotonic, timeout_s=self.cfg.dedupe_brokers_publish_timeout_s)

    def delivered_elsewhere_up_to(self) -> int:
        """The latest watermark of the holders before this replica (the one it follows, or took over
        from), never past this replica's own clock."""
        now = self._now_ms()
        if self._peer_watermark > now:
            with self._lock:
                first = self._ahead_reported != self._peer_watermark
                self._ahead_reported = self._peer_watermark
                if first:
                    self.counters.watermark_ahead += 1
            if first:
                log.warning("shard %s: the holder's watermark %d is %d ms ahead of this replica's clock; using %d "
                            "(check the hosts' clocks)", self.path, self._peer_watermark, self._peer_watermark - now,
                            now)
            return now
        return self._peer_watermark

    def delivered_elsewhere(self, due: np.ndarray, origins: np.ndarray, queue_names: Sequence[str]) -> np.ndarray:
        """Which entries a holder delivered: due by its watermark (and by this replica's clock) and, for
        an entry whose origin is known, below the offset up to which that holder had stored its queue.

        An entry with no known origin (the Python API, a backfill, data written before origins) is
        judged by the watermark alone, as before (docs/HA.md says what that leaves open).
        """
        now = self._now_ms()
        with self._lock:
            marks = list(self._marks.values())
        out = covered_by(marks, due, origins, queue_names, now)
        unknown = origins["queue"] < 0
        late = int((~out & (due <= self._peer_watermark) & ~unknown).sum()) if self._active else 0
        if late:
            with self._lock:
                self.counters.late_arrivals += late
        return out

    def count(self, peer_delivered: int, held: int) -> None:
        """Counted by the engine's dispatcher."""
        with self._lock:
            self.counters.peer_delivered += peer_delivered
            self.counters.held += held

    # ---- lifecycle ----------------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The epoch of the lease while this replica holds it, else 0."""
        return self._epoch if self._active else 0

    @property
    def took_over_ms(self) -> int:
        """When (epoch ms) this replica last became the holder (0: never)."""
        return self._took_over_ms

    def start(self, watermark_source: Callable[[], int | DeliveredMark], timeout: float = 30.0,
              offsets_source: Callable[[], dict[str, int]] | None = None) -> "ShardReplica":
        """Connect to ZooKeeper and start contending; `watermark_source` is the engine's delivered_up_to
        (or `delivered_up_to_except`, whose exceptions go with the mark), `offsets_source` its ingest's stored offsets per queue (published with it)."""
        self._watermark_source = watermark_source
        self._offsets_source = offsets_source
        try:
            self._client.start(timeout=timeout)
        except KazooTimeoutError as e:
            raise ZooKeeperUnreachableError(self.cfg.zookeeper, timeout) from e
        try:
            self._claim_identity()  # first: a replica refused creates nothing under its root
            self._history.join(self._client, f"{self.path}/lease", self._stopping)  # the tree a new session must find
        except BaseException as e:
            self._client.stop()
            self._client.close()
            if isinstance(e, (KazooException, KazooTimeoutError)):
                raise ZooKeeperJoinError(self.cfg.zookeeper, self.cfg.replica_id, self.path, e) from e
            raise
        self._thread = threading.Thread(target=self._run, name="timewheel-replica", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop sending, publish a last watermark if holding, and leave (the next replica takes over at once)."""
        self.fence.revoke()
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(self.fence.session_timeout_s)
            if self._thread.is_alive():  # in a request made while kazoo reconnects: ending the session fails it
                end_session(self._client)
            self._thread.join()
        if self._active and self._client.connected:  # kazoo holds a request made while reconnecting until it is
            try:
                self._publish()
            except ZOOKEEPER_ERRORS:
                log.warning("could not publish the last watermark of shard %s", self.path, exc_info=True)
        elif self._active:
            log.warning("not connected to ZooKeeper: the last watermark of shard %s is not published", self.path)
        self._active = False
        end_session(self._client)  # its lease node goes with it: the next replica takes over at once

    def counter_values(self) -> dict[str, int]:
        """A copy of the counters (with the shared brokers' writes that failed and parts found unreadable)."""
        with self._lock:
            counters = dict(vars(self.counters))
        return {**counters, **(self._brokers.counters() if self._brokers is not None else {})}

    def status(self) -> dict[str, object]:
        """This replica's view: holder or not, epoch, watermarks, fence, counters, failing ZooKeeper rounds, brokers."""
        counters = self.counter_values()
        return {"shard": self.cfg.shard, "shards": self.cfg.shards, "replica": self.cfg.replica_id,
                "holder": self._active, "epoch": self.epoch, "peer_watermark_ms": self._peer_watermark,
                "published_watermark_ms": self._published.watermark_ms,
                "published_exceptions": len(self._published.exceptions),
                "fence_remaining_s": round(self.fence.remaining_s(), 3) if self._active else None,
                **(self.eligibility.status() if self.eligibility is not None else {"eligible": True}), **counters,
                **self.zookeeper_rounds.status(), **(self._brokers.status() if self._brokers is not None else {})}

    def status_document(self) -> dict[str, object]:
        """This replica's view and every shard as ZooKeeper has it, or why not (`coordination.status`)."""
        from coordination.status import shards_document

        return {"replica": self.status(), **shards_document(self._client, self.cfg, self.delay_topic, self._now_ms())}

    # ---- the contender's loop -----------------------------------------------------------------------

    def _on_state(self, state: str) -> None:
        """Kazoo's connection callback (its own thread): any doubt about the session stops sending."""
        if state in (KazooState.SUSPENDED, KazooState.LOST):
            self.fence.revoke()
            if state == KazooState.LOST:
                self._session = None  # the node went with the session
            self._wake.set()

    def _on_children(self, _event: object) -> None:
        """The contenders changed (a holder left): look at once. One bound method, so kazoo keeps one watcher."""
        self._wake.set()

    def _on_lease_node(self, event: WatchedEvent) -> None:
        """Our lease node was deleted (by hand: our session lives): stop sending now, not at the next round."""
        if event.type == EventType.DELETED:
            self.fence.revoke()
            self._wake.set()

    def dead_threads(self) -> list[str]:
        """The replica's thread, if it ended while the replica runs (an error escaped it)."""
        t = self._thread
        return [t.name] if t is not None and not t.is_alive() and not self._stopping.is_set() else []

    def thread_failures(self) -> dict[str, str]:
        """Of the threads `dead_threads` names, the error that ended each."""
        return {name: self._failure for name in self.dead_threads()} if self._failure is not None else {}

    def _run(self) -> None:
        try:
            self._contend()
        except Exception as e:
            self._failure = f"{type(e).__name__}: {e}"
            # stop sending now; the service sees the thread dead, stops, and so hands the lease on
            self.fence.revoke()
            self._active = False
            log.critical("the replica thread of shard %s died; this replica no longer sends, and its service "
                         "stops to hand the lease on", self.path, exc_info=True)

    def _contend(self) -> None:
        next_publish = 0.0
        while not self._stopping.is_set():
            renew_every = self.fence.session_timeout_s / 6  # several confirmations per (granted) fencing period
            self._wake.clear()
            holding = False
            try:
                holding = self._step()
                if holding and self._brokers is not None:  # at once when a broker was learnt: sends wait for it
                    self._brokers.publish(self._client, self._epoch)
                if holding and self._monotonic() >= next_publish:
                    self._publish()  # one that fails is tried again next round: a round skipping it proves nothing
                    next_publish = self._monotonic() + self.cfg.watermark_interval_s
            except ZOOKEEPER_ERRORS as e:
                self.zookeeper_rounds.failed(e)  # logged there
                holding = self._lose("ZooKeeper request failed")
            self.zookeeper_rounds.end_round()
            wait = (min(renew_every, max(0.0, next_publish - self._monotonic())) if holding
                    else min(renew_every, self._succession.wait_s() or renew_every))  # a takeover's wait ends
            self._wake.wait(wait)

    def _step(self) -> bool:
        """One round: make sure we contend, find the holder, confirm or follow. True when holding."""
        client = self._client
        client_id = client.client_id
        self._history.check(client)  # ZooKeeper replaced (its data rebuilt, or the shard's tree gone): the thread ends
        if client_id is None:
            # Not connected (kazoo reconnecting after a dropped connection, the session still ours
            # maybe): nothing can be confirmed, nor our nodes told from another process's, until it is.
            self.zookeeper_rounds.failed("not connected to ZooKeeper (its client keeps reconnecting)")
            return self._lose("not connected to ZooKeeper")
        session = client_id[0]
        eligible = self.eligibility.check() if self.eligibility is not None else True
        if self._node is None or self._session is None or self._session != session:
            self._lose("session changed")
            self._claim_identity()
            if not eligible:  # a directory with a gap, or still catching up: a standby without a lease node
                self._remember(self._read_mark())
                return False
            self._node = our_node(client, f"{self.path}/lease", self._node_prefix, session) or client.create(
                f"{self.path}/lease/{self._node_prefix}", self.cfg.replica_id.encode(), ephemeral=True,
                sequence=True).rsplit("/", 1)[1]
            self._session = session
            self._succession.new_node()
        sent_at = self._monotonic()
        # sync first: a ZooKeeper follower cut off from its leader cannot answer it, so a stale view
        # of the contenders (a session the leader already expired) never confirms the lease
        client.sync(f"{self.path}/lease")
        children = sorted((c for c in client.get_children(f"{self.path}/lease", watch=self._on_children)
                           if c.startswith(_PREFIX)), key=lease_sequence)
        if self._node not in children:
            # under its own session only a delete by hand takes it: stop sending, contend again as a standby
            self._lose(f"its lease node {self._node} was deleted while its session lives, by hand or by a tool; it "
                       f"contends again as a standby, its messages kept")
            self._node = None
            return False
        self._succession.look(client, f"{self.path}/lease", children, self._node)
        if children[0] != self._node:
            self._lose("another replica holds the lease")
            self._remember(self._read_mark())
            return False
        stat = client.exists(f"{self.path}/lease/{self._node}", watch=self._on_lease_node)
        if stat is None or stat.ephemeralOwner != self._session:
            self._node = None
            return self._lose("lease node not ours")
        if not self._active and self._succession.wait_s() > 0:  # an earlier holder's fence may still be open
            self._remember(self._read_mark())
            return False
        # ZooKeeper expires the session after the timeout it granted, which may be shorter than the one asked
        self.fence.set_session_timeout(granted_session_timeout_s(client, self.cfg.session_timeout_s))
        if not self._active:
            self._take_over(self._read_mark())
        self.fence.confirmed(sent_at)
        return True

    def _read_mark(self) -> Watermark:
        """The shard's watermark; one that cannot be read counts as none (what it covered is sent again,
        never dropped) and is reported. First the brokers the holder's copies went to join this replica's
        (each standby round and at a takeover, before any look-up: down ones included)."""
        if self._brokers is not None:
            self._brokers.follow(self._client)
        try:
            return read_watermark(self._client, self.path)
        except MalformedWatermark:
            with self._lock:
                self.counters.malformed_watermarks += 1
            log.error("shard %s: cannot read the watermark znode; ignoring it (messages it may cover are sent "
                      "again, not dropped)", self.path, exc_info=True)
            return Watermark()

    def _remember(self, mark: Watermark) -> None:
        """Keep the latest watermark of each epoch (of the last few epochs)."""
        if not mark.epoch:
            return
        with self._lock:
            old = self._marks.get(mark.epoch)
            if old is None or mark.watermark_ms >= old.watermark_ms:
                self._marks[mark.epoch] = mark
            for e in sorted(self._marks)[:-_EPOCHS_KEPT]:
                del self._marks[e]  # older holders' marks: what only they covered is held, never dropped
            self._peer_watermark = max(self._peer_watermark, mark.watermark_ms)

    def _claim_identity(self) -> None:
        """Register with the delay topic's members (ReplicaSetMismatch at start: `coordination.members`), then
        hold this replica's id in the shard (ReplicaIdTaken: `coordination.lease.claim_replica_id`)."""
        self._members.join(self._client)
        claim_replica_id(self._client, self.path, self.cfg.replica_id, fence_advert(self._succession.fence_s))

    def _take_over(self, mark: Watermark) -> None:
        epoch = epoch_of(self._node) if self._node else 0
        if epoch < mark.epoch or (epoch == mark.epoch and mark.replica != self.cfg.replica_id):
            # the lease path deleted and created again after this round's look at it: epochs went back
            raise LeasePathDeletedError(f"{self.path}/lease", f"{self.path}/watermark")
        self._remember(mark)
        with self._lock:
            self._epoch = epoch
            self._took_over_ms = self._now_ms()
            self._published = Watermark(epoch, self._peer_watermark, self.cfg.replica_id, self._took_over_ms)
            # the last holder was alive when it published, and at most one interval longer with no
            # further watermark: what was due by then may have gone out twice
            self._duplicates_until = (mark.published_ms + int(self.cfg.watermark_interval_s * 1000) if mark.epoch
                                      else NO_WATERMARK)
            self.counters.takeovers += 1
            self._active = True
        log.log(self.zookeeper_rounds.transition_level(), "shard %s: this replica (%s) holds the lease, epoch %d; "
                "delivering what is due after %d (the last holder's watermark, epoch %d)", self.path,
                self.cfg.replica_id, epoch, self._peer_watermark, mark.epoch)

    def _lose(self, why: str) -> bool:  # False: not holding, a round's answer
        self.fence.revoke()
        if self._active:
            with self._lock:
                self._active = False
                self.counters.losses += 1
            log.log(self.zookeeper_rounds.transition_level(), "shard %s: this replica (%s) no longer holds the "
                    "lease (%s); not sending", self.path, self.cfg.replica_id, why)
        return False

    def _publish(self) -> None:
        """Publish the engine's watermark and stored offsets under our epoch (`coordination.watermark.engine_mark`;
        a frozen mark, `DeliveredMark.frozen`, is not published)."""
        if self._watermark_source is None:
            return
        mark = engine_mark(self._epoch, self.cfg.replica_id, self._now_ms, self._watermark_source, self._offsets_source)
        if mark is None:
            return
        if publish_watermark(self._client, self.path, mark):
            self._published = mark
            with self._lock:
                self.counters.watermarks_published += 1
        else:
            self._lose("a newer epoch owns the watermark")

    def note_sent(self, messages: Sequence[Message]) -> None:
        """Count what this holder sent that the last one may have sent too (due after its watermark and
        before its last sign of life: those before the watermark are never sent here)."""
        self.note_sent_due(np.fromiter((m.deliver_at_ms for m in messages), np.int64, len(messages)))

    def note_sent_due(self, due: np.ndarray) -> None:
        """`note_sent` for the due times (epoch ms) of what was sent."""
        until = self._duplicates_until
        if until != NO_WATERMARK:
            n = int((due <= until).sum())
            if n:
                with self._lock:
                    self.counters.possible_duplicates += n
