"""When a replica decides that ZooKeeper lost its history (`coordination._history`), with a scripted
client and probe: never while connected nor within a session of the drop, never while ZooKeeper
does not answer, and only when it stands before what the replica's client saw."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from coordination import _history
from coordination._history import LostHistoryWatch
from coordination.errors import ZooKeeperHistoryLostError


@dataclass
class _Client:
    connected: bool = True
    last_zxid: int = 0x500


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _watch(monkeypatch: pytest.MonkeyPatch, answers: list[int | None]) -> tuple[LostHistoryWatch, _Clock, list[str]]:
    probes: list[str] = []

    def probe(hosts: str, timeout_s: float) -> int | None:
        probes.append(hosts)
        return answers.pop(0)

    monkeypatch.setattr(_history, "ensemble_zxid", probe)
    clock = _Clock()
    return LostHistoryWatch("zk1:2181", 4.0, clock), clock, probes


def test_a_client_that_an_ensemble_behind_it_refuses_is_told_once_a_session_has_passed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    watch, clock, probes = _watch(monkeypatch, [None, 0x3])
    client: Any = _Client(connected=False)
    watch.check(client)
    clock.t += 3.9
    watch.check(client)
    assert probes == []  # a connection that comes back within a session is not probed for
    clock.t += 0.2
    watch.check(client)  # ZooKeeper does not answer: nothing to tell
    assert probes == ["zk1:2181"]
    clock.t += 3.9
    watch.check(client)
    assert len(probes) == 1  # once a session
    clock.t += 0.2
    with pytest.raises(ZooKeeperHistoryLostError) as e:
        watch.check(client)
    assert "0x3, before 0x500" in str(e.value) and "'zk1:2181'" in str(e.value) and "restart" in str(e.value)


def test_an_ensemble_at_or_past_what_the_client_saw_is_the_same_history(monkeypatch: pytest.MonkeyPatch) -> None:
    watch, clock, probes = _watch(monkeypatch, [0x500, 0x9000])
    client: Any = _Client(connected=False)
    watch.check(client)
    for _ in range(2):
        clock.t += 4.1
        watch.check(client)
    assert len(probes) == 2


def test_a_connection_back_starts_the_count_again(monkeypatch: pytest.MonkeyPatch) -> None:
    watch, clock, probes = _watch(monkeypatch, [0x3])
    client: Any = _Client(connected=False)
    watch.check(client)
    clock.t += 3.0
    client.connected = True
    watch.check(client)
    client.connected = False
    clock.t += 3.0
    watch.check(client)
    assert probes == []
    clock.t += 4.0
    with pytest.raises(ZooKeeperHistoryLostError):
        watch.check(client)
