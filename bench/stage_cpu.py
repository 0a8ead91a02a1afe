"""CPU of named stages inside a running engine, measured where they run (their thread's CPU clock).

`StageClock` wraps methods of the engine's classes for as long as it is entered, and adds up the
calling thread's CPU (`time.thread_time`) spent inside each: what a stage costs among the broker's
and the other threads' traffic, caches as they really are, which a hot-loop benchmark cannot show
(bench/RESULTS_HOTPATHS.md, runs 10 and 11). A stage called inside another is counted in both.
Each wrap adds about a microsecond of its own per call.
"""
from __future__ import annotations

import functools
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any

__all__ = ["DELIVERY_STAGES", "StageClock"]

#: (module, class, method, label): the delivery path of `timewheel serve`, outermost first
DELIVERY_STAGES: tuple[tuple[str, str, str, str], ...] = (
    ("timewheel.timer", "TimerDriver", "_pass", "timer pass"),
    ("timewheel.dispatch_queue", "DispatchQueue", "await_turn", "queue: await turn"),
    ("timewheel.dispatcher", "Dispatcher", "dispatch_pass", "dispatch pass"),
    ("timewheel.dispatch_queue", "DispatchQueue", "take", "  queue: take"),
    ("storage.store", "ScheduleStore", "read_record_bytes", "  read and check the records"),
    ("forwarder.delivery", "RocketMQSink", "send_records", "  sink: send the records"),
    ("forwarder.record_batches", "", "cut_records", "    cut into batch bodies"),
    ("forwarder.rocketmq.producer", "RemotingProducer", "_exchange", "    request out, answer in"),
    ("timewheel.dispatcher", "Dispatcher", "_record", "  record the outcomes"),
)


class StageClock:
    """Adds up each wrapped stage's CPU on the calling thread, while entered."""

    def __init__(self, stages: Iterable[tuple[str, str, str, str]] = DELIVERY_STAGES) -> None:
        """`stages`: (module, class or "" for a module function, method, label)."""
        self.stages = tuple(stages)
        self.cpu: defaultdict[str, float] = defaultdict(float)
        self.calls: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._undo: list[Callable[[], None]] = []

    def __enter__(self) -> "StageClock":
        import importlib
        for module, cls, method, label in self.stages:
            mod = importlib.import_module(module)
            owner: Any = getattr(mod, cls) if cls else mod
            original = getattr(owner, method)
            setattr(owner, method, self._timed(original, label))
            self._undo.append(functools.partial(setattr, owner, method, original))
            if not cls:  # a module function may be imported by name elsewhere: rebind those too
                self._rebind_importers(original, label)
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        while self._undo:
            self._undo.pop()()

    def _rebind_importers(self, original: Callable[..., Any], label: str) -> None:
        import sys
        for mod in list(sys.modules.values()):
            for name, value in list(getattr(mod, "__dict__", {}).items()):
                if value is original:
                    setattr(mod, name, self._timed(original, label))
                    self._undo.append(functools.partial(setattr, mod, name, original))

    def _timed(self, fn: Callable[..., Any], label: str) -> Callable[..., Any]:
        cpu, calls, lock = self.cpu, self.calls, self._lock

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = time.thread_time() - t0
                with lock:
                    cpu[label] += spent
                    calls[label] += 1
        return timed

    def reset(self) -> None:
        """Forget what was counted so far (the measured window starts now)."""
        with self._lock:
            self.cpu.clear()
            self.calls.clear()

    def table(self, per: int, unit: str) -> str:
        """Each stage's CPU per `per` (µs a `unit`), and per call, in the order the stages were named."""
        lines = [f"{'stage':34s} {'µs a ' + unit:>12s} {'calls':>8s} {'µs a call':>10s}"]
        for _, _, _, label in self.stages:
            n = self.calls[label]
            if n:
                lines.append(f"{label:34s} {self.cpu[label] / per * 1e6:12.1f} {n:8d} {self.cpu[label] / n * 1e6:10.1f}")
        return "\n".join(lines)
