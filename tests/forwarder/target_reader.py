"""A pull consumer of a target topic that keeps everything it received, for tests that check delivery."""
from __future__ import annotations

import threading
from collections.abc import Sequence
from types import TracebackType

from forwarder.rocketmq import ReceivedMessage, RemotingPullConsumer


class TargetReader:
    """Reads one topic from its start (while entered) and keeps every message."""

    def __init__(self, namesrv: str, group: str, topic: str) -> None:
        self._lock = threading.Lock()
        self._received: list[ReceivedMessage] = []
        self._consumer = RemotingPullConsumer(namesrv, group, topic, self._on_batch)

    def _on_batch(self, batch: Sequence[ReceivedMessage]) -> bool:
        with self._lock:
            self._received.extend(batch)
        return True

    def messages(self) -> list[ReceivedMessage]:
        """What it received so far."""
        with self._lock:
            return list(self._received)

    def __enter__(self) -> "TargetReader":
        self._consumer.start()
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self._consumer.stop()
