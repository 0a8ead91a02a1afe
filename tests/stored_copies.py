"""Counting what a test's consumer received as copies stored on the broker, not as receipts.

RocketMQ's consumers are at-least-once: the C++ push consumer the tests use may hand the same stored
message over twice (apache/rocketmq-client-cpp #43, #331, #479), which says nothing about the
engine. A second copy *stored* on the target (another queue position) is the engine's. So a checker
counts stored positions per key, and the consumer's redeliveries apart.
"""
from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable
from typing import Generic, Protocol, TypeVar

K = TypeVar("K", bound=Hashable)

#: where the broker stored a copy: queue id, queue offset, commit-log offset, store time (epoch ms).
#: One broker's commit-log offset tells its copies apart; with the queue position, two brokers' too.
Position = tuple[int, int, int, int]


class StoredMessage(Protocol):
    """What a received message says of where it was stored."""

    @property
    def queue_id(self) -> int: ...
    @property
    def queue_offset(self) -> int: ...
    @property
    def commit_log_offset(self) -> int: ...
    @property
    def store_timestamp(self) -> int: ...


def position(m: StoredMessage) -> Position:
    """Where the broker stored `m`."""
    return (m.queue_id, m.queue_offset, m.commit_log_offset, m.store_timestamp)


class StoredCopies(Generic[K]):
    """Stored copies seen per key (thread-safe: a push consumer calls `add` from its own threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._copies: dict[K, set[Position]] = {}
        self._receipts: dict[K, int] = {}

    def add(self, key: K, m: StoredMessage) -> bool:
        """Count one receipt of `m` under `key`; whether it is a copy not seen before (False: the
        consumer handed a stored copy over again)."""
        where = position(m)
        with self._lock:
            self._receipts[key] = self._receipts.get(key, 0) + 1
            seen = self._copies.setdefault(key, set())
            if where in seen:
                return False
            seen.add(where)
            return True

    def keys(self) -> set[K]:
        """Every key received at least once."""
        with self._lock:
            return set(self._copies)

    def copies(self, key: K) -> int:
        """How many distinct stored copies of `key` arrived (0: none)."""
        with self._lock:
            return len(self._copies.get(key, ()))

    def duplicates(self, keys: Iterable[K] | None = None) -> int:
        """Copies beyond the first, over `keys` (default: every key)."""
        with self._lock:
            chosen = self._copies.keys() if keys is None else keys
            return sum(max(0, len(self._copies.get(k, ())) - 1) for k in chosen)

    def redeliveries(self, keys: Iterable[K] | None = None) -> int:
        """Receipts of a copy already received, over `keys` (default: every key)."""
        with self._lock:
            chosen = self._copies.keys() if keys is None else keys
            return sum(self._receipts.get(k, 0) - len(self._copies.get(k, ())) for k in chosen)

    def described(self, keys: Iterable[K] | None = None, limit: int = 5) -> tuple[str, ...]:
        """For the first `limit` keys with more than one copy: the key, then each copy's
        `q<id>@<offset> stored <ms>`, for a failure message."""
        with self._lock:
            chosen = list(self._copies.keys() if keys is None else keys)
            out = []
            for k in chosen:
                c = self._copies.get(k, set())
                if len(c) > 1:
                    shown = k.decode(errors="replace") if isinstance(k, bytes) else str(k)
                    out.append(f"{shown}: " + ", ".join(f"q{q}@{o} stored {t}" for q, o, _, t in sorted(c)))
                if len(out) >= limit:
                    break
            return tuple(out)
