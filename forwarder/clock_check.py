"""The host clock against the brokers': while it runs far ahead of theirs, delivery holds every send.

The engine decides what is due by its host's clock, but a relative delay is counted from the
broker's store timestamp (`forwarder.contract.delay_base`): the brokers' clocks are the reference
the due times were made in. A host clock far ahead of them (a wrong RTC after a reboot, a VM
restored with a bad clock, NTP misconfigured) makes every message held up to that time due at
once, and delivery would send them all early. So:

- `BrokerClockProbe` measures the difference with the copy finder's machinery: a small message to
  `dedupe_sentinel_topic` (one queue on every broker) by `RemotingProducer.send_to_every_queue`,
  the host's time taken just before the send (t0) and after the answer (t1), then each copy's store
  timestamp (the broker's clock) read back by its key through the message index (`MessageLookup`).
  The host is ahead by t0 - stored, behind by stored - t1; in between, within the round trip, the
  clocks agree.
- `ClockGuard` is a RecordSink around delivery, as `coordination.FencedSink` is: while the last
  measurement says the host is ahead of a broker by more than `rocketmq.max_clock_ahead_ms`, every
  batch is held (queued again, no attempt spent), and its check goes down with the fence it was
  handed as the write's last. A host behind only makes sends late: warned about, never held.
  It measures before the engine's first send, then every `PERIOD_S` on a thread of its own, and
  every `HELD_PERIOD_S` while holding, so delivery resumes soon after the clock is fixed.
- A probe that cannot run (no sentinel topic, no broker answering) holds nothing: the guard never
  stops delivery for want of a measurement, it says so in status and once in the log. A hold is
  lifted by a measurement that agrees; failed probes leave the last measurement in force.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import ClassVar

import numpy as np

from forwarder.config import RocketMQConfig
from forwarder.errors import ForwarderError
from forwarder.rocketmq import MessageLookup, OutgoingMessage, Receipt, RemotingError, RemotingProducer
from storage import RecordBytes
from timewheel.message import Fence, Message, RecordSink, SendResults

__all__ = ["BrokerClockProbe", "ClockGuard", "ClockProbeError", "ClockReading", "HELD_PERIOD_S", "PERIOD_S"]

log = logging.getLogger("timewheel.clock_check")

#: how often the clock is measured while sends go, and while they are held
PERIOD_S = 30.0
HELD_PERIOD_S = 2.0
#: how long the service's start waits for the first measurement before the engine sends
FIRST_WAIT_S = 5.0
#: the look-up's window around the host's time: the broker's clock may be years off it (whole seconds)
_WINDOW_MS = 10 * 366 * 86_400_000
#: how long a sentinel may take to appear in its broker's index (ms after its send, as a rule)
_INDEX_WAIT_S = 5.0


class ClockProbeError(ForwarderError):
    """The host clock could not be measured against the brokers'; nothing is held for it."""

    retriable: ClassVar[bool] = True


@dataclass(frozen=True, slots=True)
class ClockReading:
    """One broker's clock against the host's, as measured."""

    broker: str
    offset_ms: int  # host minus broker: positive, the host is ahead; 0 within the round trip
    round_trip_ms: int  # t1 - t0: how precise the offset is
    at_ms: int  # the host's time when measured (t1)


class BrokerClockProbe:
    """Measures the host clock against each broker's, with a sentinel message read back by its key."""

    def __init__(self, cfg: RocketMQConfig, now_ms: Callable[[], int], *, lookup: MessageLookup | None = None,
                 producer: RemotingProducer | None = None) -> None:
        """`now_ms`: the engine's clock (what decides what is due); connects lazily."""
        self.topic = cfg.dedupe_sentinel_topic
        self.now_ms = now_ms
        self._lookup = lookup or MessageLookup(cfg.namesrv, timeout_ms=cfg.send_timeout_ms, security=cfg.security())
        self._producer = producer or RemotingProducer(cfg.namesrv, cfg.producer_group, timeout_ms=cfg.send_timeout_ms,
                                                      security=cfg.security())
        self._stop = threading.Event()

    def measure(self) -> list[ClockReading]:
        """One reading per broker that stored and indexed the sentinel; ClockProbeError if none did."""
        t0 = self.now_ms()
        try:
            receipts = self._producer.send_to_every_queue(OutgoingMessage(self.topic, b"clock"))
        except RemotingError as e:
            raise ClockProbeError(f"no sentinel could be sent to {self.topic} ({type(e).__name__}: {e}): create it "
                                  f"with a queue on every broker (rocketmq.dedupe_sentinel_topic)") from e
        t1 = self.now_ms()
        keys = {r.msg_id: r.broker for r in receipts if isinstance(r, Receipt)}
        if not keys:
            errors = "; ".join(sorted({f"{type(r).__name__}: {r}" for r in receipts})) or "no queue"
            raise ClockProbeError(f"no broker stored the sentinel sent to {self.topic}: {errors}")
        stored: dict[str, int] = {}
        waited = 0.0
        while len(stored) < len(keys) and waited < _INDEX_WAIT_S and not self._stop.is_set():
            answered = self._lookup.lookup(self.topic, [k for k in keys if k not in stored],
                                           max(1, t0 - _WINDOW_MS), t1 + _WINDOW_MS)
            for key, got in answered.items():
                if got.copies:
                    stored[key] = got.copies[0].store_timestamp
            if len(stored) < len(keys):  # indexed a few ms after the send is acknowledged
                self._stop.wait(0.01)
                waited += 0.01
        if not stored:
            raise ClockProbeError(f"the sentinel sent to {self.topic} was not found in the message index of broker(s) "
                                  f"{', '.join(sorted(set(keys.values())))} within {_INDEX_WAIT_S:.0f} s")
        return [ClockReading(keys[k], _offset(t0, t1, s), t1 - t0, t1) for k, s in sorted(stored.items())]

    def close(self) -> None:
        """Stop a measurement under way; close the producer's and the look-up's connections."""
        self._stop.set()
        self._lookup.close()
        self._producer.close()


def _offset(t0: int, t1: int, stored: int) -> int:
    """Host minus broker from one send: ahead by t0 - stored, behind by stored - t1, else they agree."""
    if stored < t0:
        return t0 - stored
    if stored > t1:
        return t1 - stored
    return 0


class ClockGuard:
    """A RecordSink that holds every send while the host clock is measured far ahead of a broker's."""

    def __init__(self, inner: RecordSink, probe: BrokerClockProbe, max_ahead_ms: int, *, period_s: float = PERIOD_S,
                 held_period_s: float = HELD_PERIOD_S) -> None:
        """Wrap the delivery sink; `max_ahead_ms`: `rocketmq.max_clock_ahead_ms` (0: measure, never hold)."""
        self.inner = inner
        self.probe = probe
        self.max_ahead_ms = max_ahead_ms
        self.period_s = period_s
        self.held_period_s = held_period_s
        self.max_in_flight = int(getattr(inner, "max_in_flight", 1))
        self.linger_ms = int(getattr(inner, "linger_ms", 0))
        self.linger_max_ms: int | None = getattr(inner, "linger_max_ms", None)
        self._lock = threading.Lock()
        self._readings: list[ClockReading] = []
        self._problem: str | None = None  # why the last probe could not measure
        self._holding = False
        self._stop = threading.Event()
        self._first = threading.Event()
        self._thread: threading.Thread | None = None
        self.counters = {"probes": 0, "probe_failures": 0, "held": 0}

    @classmethod
    def started(cls, inner: RecordSink, cfg: RocketMQConfig, now_ms: Callable[[], int]) -> ClockGuard:
        """A guard around `inner` for `cfg`, its first measurement taken (or `FIRST_WAIT_S` waited)."""
        return cls(inner, BrokerClockProbe(cfg, now_ms), cfg.max_clock_ahead_ms).start(FIRST_WAIT_S)

    # ---- the sink --------------------------------------------------------------------------------------

    def may_send(self) -> bool:
        """False while the last measurement says the host is ahead of a broker by more than the bound."""
        with self._lock:
            return not self._holding

    def send_records(self, records: RecordBytes, extra: Mapping[str, str] | None = None,
                     fence: Fence | None = None) -> list[bool]:
        """Send stored records unless held; the clock's check joins `fence` as the write's last."""
        if not self.may_send():
            return self._all_held(len(records))
        check = self.may_send if fence is None else (lambda: fence() and self.may_send())
        return self.inner.send_records(records, extra, check)

    def send_batch(self, messages: Sequence[Message]) -> list[bool]:
        """Send messages unless held; one bool per message."""
        if not self.may_send():
            return self._all_held(len(messages))
        return self.inner.send_batch(messages)

    def _all_held(self, n: int) -> SendResults:
        """Nothing sent: every row held, with why."""
        with self._lock:
            self.counters["held"] += n
        why = "held: this host's clock is ahead of the brokers' (rocketmq.max_clock_ahead_ms)"
        return SendResults([False] * n, errors=[why] * n, held=np.ones(n, bool))

    # ---- the measurements ------------------------------------------------------------------------------

    def start(self, wait_s: float) -> ClockGuard:
        """Measure on a thread of its own; wait up to `wait_s` for the first measurement."""
        self._thread = threading.Thread(target=self._run, name="timewheel-clock-check", daemon=True)
        self._thread.start()
        self._first.wait(wait_s)
        return self

    def _run(self) -> None:
        """Measure now, then every `period_s` (every `held_period_s` while holding) until closed."""
        while not self._stop.is_set():
            self.probe_once()
            self._first.set()
            if self._stop.wait(self.period_s if self.may_send() else self.held_period_s):
                return

    def probe_once(self) -> None:
        """Measure the clock once and hold or release sends by what it says."""
        try:
            readings = self.probe.measure()
        except (ClockProbeError, RemotingError) as e:
            self._failed(str(e))
            return
        except Exception as e:  # never fatal: an unmeasured clock holds nothing
            log.exception("the clock check failed unexpectedly")
            self._failed(f"{type(e).__name__}: {e}")
            return
        worst = max(readings, key=lambda r: r.offset_ms)
        holding = bool(self.max_ahead_ms) and worst.offset_ms > self.max_ahead_ms
        with self._lock:
            was_holding, problem, before = self._holding, self._problem, self._readings
            self._readings, self._problem, self._holding = readings, None, holding
            self.counters["probes"] += 1
        if problem is not None:
            log.info("the host clock is measured against the brokers' again")
        if holding and not was_holding:
            log.error("%s", self._held_why(worst))
        elif was_holding and not holding:
            log.warning("the host clock agrees with the brokers' again (%+d ms against broker %s): delivery resumes",
                        worst.offset_ms, worst.broker)
        behind = self._behind(readings)
        if behind is not None and self._behind(before) is None:
            log.warning("%s", behind)

    def _failed(self, why: str) -> None:
        """A probe that could not measure: said once, nothing held for it."""
        with self._lock:
            first, self._problem = self._problem is None, why
            self.counters["probe_failures"] += 1
        if first:
            log.warning("the host clock cannot be measured against the brokers' (%s); sends are not held for it, "
                        "and a host clock far ahead of the brokers' would send messages early", why)

    # ---- what operators see ----------------------------------------------------------------------------

    def _held_why(self, worst: ClockReading) -> str:
        """The reason sends are held, and what to do."""
        return (f"this host's clock is {worst.offset_ms / 1000:,.1f} s ahead of broker {worst.broker}'s (more than "
                f"rocketmq.max_clock_ahead_ms = {self.max_ahead_ms} ms; the due times were made by the brokers' "
                f"clocks): every send is held so that nothing goes out early. Fix this host's clock (NTP, its RTC); "
                f"messages are held, none lost or sent early, and delivery resumes at the next measurement "
                f"(every {self.held_period_s:g} s) that agrees")

    def _behind(self, readings: Sequence[ClockReading]) -> str | None:
        """A warning when the host is behind a broker by more than the bound (sends late, never early)."""
        late = min(readings, key=lambda r: r.offset_ms, default=None)
        if late is None or not self.max_ahead_ms or -late.offset_ms <= self.max_ahead_ms:
            return None
        return (f"this host's clock is {-late.offset_ms / 1000:,.1f} s behind broker {late.broker}'s: messages are "
                f"sent that much late (never early, so nothing is held); fix this host's clock (NTP)")

    def not_ready_why(self) -> list[str]:
        """Why the service is not ready because of the clock (none: sends are not held)."""
        with self._lock:
            holding, readings = self._holding, list(self._readings)
        return [self._held_why(max(readings, key=lambda r: r.offset_ms))] if holding and readings else []

    def offset_ms(self) -> int | None:
        """Host minus broker of the last measurement, the broker the host is most ahead of (None: never measured)."""
        with self._lock:
            return max((r.offset_ms for r in self._readings), default=None)

    def status(self) -> dict[str, object]:
        """What `timewheel status` shows: the last measurement per broker, whether sends are held, warnings."""
        with self._lock:
            readings, problem, holding = list(self._readings), self._problem, self._holding
            counters = dict(self.counters)
        warnings = [w for w in (self._behind(readings),) if w]
        if problem is not None:
            warnings.append(f"the host clock cannot be measured against the brokers' ({problem}): sends are not "
                            f"held for it" + (", the last measurement stands" if readings else ""))
        worst = max(readings, key=lambda r: r.offset_ms, default=None)
        return {"max_ahead_ms": self.max_ahead_ms, "holding": holding, "offset_ms": worst and worst.offset_ms,
                "broker": worst and worst.broker,
                "brokers": [asdict(r) for r in readings], "warnings": warnings, **counters}

    def close(self) -> None:
        """Stop measuring and close the probe's connections."""
        self._stop.set()
        self.probe.close()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
