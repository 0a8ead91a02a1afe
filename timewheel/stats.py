"""A snapshot of the engine's counters and sizes, as typed values (`Engine.stats()`)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Mapping

from timewheel.lateness import LatenessSummary


@dataclass(frozen=True, slots=True)
class EngineCounters:
    """Totals since the engine started."""

    scheduled: int = 0  # messages stored (duplicates excluded)
    duplicates: int = 0  # messages whose id was already stored
    delivered: int = 0
    cancelled: int = 0
    dead_lettered: int = 0
    retries: int = 0  # failed sends queued for another attempt
    corrupt: int = 0  # records found corrupt at dispatch (never served)
    send_failures: int = 0  # failed sends, each attempt
    catch_up_segments: int = 0  # past segments drained after downtime
    dispatch_log_errors: int = 0  # delivered, but the dispatch log could not say so
    cancel_requests: int = 0  # cancels handed to the engine (each queue's copy, repeats included)
    cancels_applied: int = 0  # of those, the ones applied (new to this engine; copies cost a look-up)
    cancelled_on_arrival: int = 0  # messages a tombstone cancelled as they arrived (never stored)
    cancel_tombstones_evicted: int = 0  # tombstones dropped over max_tombstones before their retention
    timer_thread_passes: int = 0  # dispatch passes the timer's thread ran itself at a low rate


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Counters, queue sizes, memory and lateness of an engine at one moment."""

    counters: EngineCounters = field(default_factory=EngineCounters)
    ready: int = 0  # due, waiting for a sender
    backlog: int = 0  # overdue entries of past segments waiting (catch-up)
    retrying: int = 0  # waiting for their next attempt
    catch_up_pending_segments: int = 0
    held_by_shaping: int = 0
    storage_corrupt_records: int = 0
    shaping: Mapping[str, object] | None = None  # the shaper's own stats, when there is one
    wheel_entries: int = 0
    wheel_bytes: int = 0
    loaded_segments: Mapping[str, int] = field(default_factory=dict)  # segment start ms -> outstanding
    lateness_ms: LatenessSummary = field(default_factory=LatenessSummary)
    tombstones: int = 0  # cancels held for messages that may still arrive
    cancels_held: int = 0  # cancels of loaded segments the dispatch queue remembers until the segment is done
    meta_store_bytes: Mapping[str, int] = field(default_factory=dict)  # the meta store's memory, by kind
    # origin sidecar rows found failing their CRC32C (read as lost: a replica set's standby holds their records)
    storage_corrupt_origin_rows: int = 0
    # origin sidecar rows written as lost since the start (recovery, the writer over a sidecar cut or deleted)
    storage_origin_rows_lost: int = 0

    def as_dict(self) -> dict[str, object]:
        """A JSON-ready dict: the counters at the top level beside the other fields (no shaping key
        without a shaper)."""
        out: dict[str, object] = {f.name: getattr(self.counters, f.name) for f in fields(EngineCounters)}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "counters" or (f.name == "shaping" and value is None):
                continue
            out[f.name] = asdict(value) if f.name == "lateness_ms" else \
                dict(value) if isinstance(value, Mapping) else value
        return out
