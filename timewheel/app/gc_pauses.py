"""The garbage collector's pauses as the service sees them, and the heap frozen after the start.

A collection holds the interpreter's lock from start to end: the timer, the sends and the pulls all
stop for it. A full (generation 2) collection walks every object the process tracks, and most of
those are the start's own (modules, settings, connections) and never garbage: `freeze_started_heap`
moves them out of the collector's sight (`gc.freeze`), so that a full collection walks what was made
since. `GcPauses` times every collection, for the metrics (`timewheel_gc_*`).
"""
from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["GcPauses", "GenerationPauses", "freeze_started_heap"]

_GENERATIONS = 3


@dataclass(frozen=True)
class GenerationPauses:
    """One generation's collections since `GcPauses.install`: how many, their time, the longest."""

    collections: int
    seconds: float
    longest_seconds: float


class GcPauses:
    """Times each collection by generation while installed (`gc.callbacks`).

    No lock: the callback runs inside a collection, which any allocation can set off, on any thread,
    the one holding such a lock included (a deadlock). Each figure is one list slot written whole; a
    reader at the same moment may see a count one ahead of its seconds, for one scrape.
    """

    def __init__(self) -> None:
        """Nothing is timed until `install`."""
        self._counts = [0] * _GENERATIONS
        self._seconds = [0.0] * _GENERATIONS
        self._longest = [0.0] * _GENERATIONS
        self._started = 0.0
        #: objects `freeze_started_heap` froze, as it counted them then: `gc.get_freeze_count()` walks
        #: the whole frozen list under the interpreter's lock (milliseconds for a million objects, every
        #: engine thread stopped), too dear for each scrape; nothing else freezes or unfreezes
        self.frozen = 0

    def install(self) -> "GcPauses":
        """Start timing collections; returns self."""
        if self._on_collection not in gc.callbacks:
            gc.callbacks.append(self._on_collection)
        return self

    def remove(self) -> None:
        """Stop timing collections (idempotent)."""
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)

    def reset(self) -> None:
        """Forget the collections timed so far (the start's own full collection, say)."""
        for g in range(_GENERATIONS):
            self._counts[g], self._seconds[g], self._longest[g] = 0, 0.0, 0.0

    def snapshot(self) -> list[GenerationPauses]:
        """Each generation's pauses so far, youngest first."""
        counts, seconds, longest = list(self._counts), list(self._seconds), list(self._longest)
        return [GenerationPauses(c, s, m) for c, s, m in zip(counts, seconds, longest)]

    def _on_collection(self, phase: str, info: dict[str, Any]) -> None:
        # Runs inside the collection, on whichever thread set it off; collections do not nest, so
        # "stop" follows its own "start".
        if phase == "start":
            self._started = time.perf_counter()
            return
        took = time.perf_counter() - self._started
        g = int(info.get("generation", 0))
        if not 0 <= g < _GENERATIONS:
            return
        self._counts[g] += 1
        self._seconds[g] += took
        if took > self._longest[g]:
            self._longest[g] = took


def freeze_started_heap() -> int:
    """Collect once, then move every object left out of the collector's sight (`gc.freeze`): call it
    when the service has started. Returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
