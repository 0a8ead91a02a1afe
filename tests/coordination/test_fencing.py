"""The fencing deadline: extended by confirmed contact, never by an answer older than a revocation."""
from __future__ import annotations

import pytest

from coordination import FencingDeadline, HAConfig
from timewheel.errors import ConfigError


class FakeMonotonic:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_holder_may_send_until_a_fraction_of_the_session_after_its_last_confirmed_request() -> None:
    clock = FakeMonotonic()
    fence = FencingDeadline(10.0, 0.6, clock)
    assert not fence.may_send()  # nothing confirmed yet
    fence.confirmed(sent_at=100.0)
    clock.t = 105.9
    assert fence.may_send()
    clock.t = 106.0  # sent at 100 + 0.6 * 10: the server cannot have expired the session before 110
    assert not fence.may_send()
    fence.confirmed(sent_at=105.5)  # a renewal sent before the deadline, answered after it
    assert fence.may_send() and fence.remaining_s() == pytest.approx(5.5)


def test_a_pause_longer_than_the_session_leaves_the_deadline_behind() -> None:
    clock = FakeMonotonic()
    fence = FencingDeadline(6.0, 0.6, clock)
    fence.confirmed(100.0)
    clock.t = 100.0 + 30  # SIGSTOP for 30 s: the monotonic clock went on
    assert not fence.may_send()


def test_an_answer_to_a_request_sent_before_a_revocation_extends_nothing() -> None:
    clock = FakeMonotonic()
    fence = FencingDeadline(10.0, 0.6, clock)
    fence.confirmed(100.0)
    clock.t = 101.0
    fence.revoke()  # connection suspended
    assert not fence.may_send()
    fence.confirmed(sent_at=100.5)  # its answer arrives late
    assert not fence.may_send()
    clock.t = 102.0
    fence.confirmed(sent_at=101.5)  # sent after the revocation, on a connection that works again
    assert fence.may_send()


def test_a_smaller_negotiated_session_shrinks_the_deadline_and_a_larger_one_does_not_grow_it() -> None:
    clock = FakeMonotonic()
    fence = FencingDeadline(10.0, 0.5, clock)
    fence.set_session_timeout(20.0)
    fence.confirmed(100.0)
    assert fence.remaining_s() == pytest.approx(5.0)
    fence.set_session_timeout(4.0)
    fence.confirmed(100.0)
    assert fence.remaining_s() == pytest.approx(5.0)  # never shortened by an older confirmation either
    fence.confirmed(104.0)
    assert fence.remaining_s() == pytest.approx(6.0)  # 104 + 0.5 * 4 - 100


@pytest.mark.parametrize("kw, key", [
    ({"zookeeper": "127.0.0.1:2181"}, "replica_id"),
    ({"zookeeper": "localhost", "replica_id": "a"}, "zookeeper"),
    ({"shards": 2, "shard": 2}, "shard"),
    ({"fence_fraction": 1.0}, "fence_fraction"),
    ({"session_timeout_s": 4.0, "watermark_interval_s": 5.0}, "watermark_interval_s"),
    ({"root": "timewheel"}, "root"),
    ({"zookeeper": "127.0.0.1:2181", "replica_id": "a/b"}, "replica_id"),
], ids=["replica_id-required", "no-port", "shard-out-of-range", "fraction", "watermark-interval", "root", "slash"])
def test_invalid_ha_settings_name_their_key(kw: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=rf"ha\.{key} = "):
        HAConfig(**kw)  # type: ignore[arg-type]


def test_a_replica_reads_its_shard_under_a_group_of_its_own() -> None:
    cfg = HAConfig(zookeeper="127.0.0.1:2181,127.0.0.1:2182", shards=3, shard=1, replica_id="b")
    assert cfg.enabled and not HAConfig().enabled
    assert [q for q in range(8) if cfg.owns_queue(q)] == [1, 4, 7]
    assert cfg.consumer_group("tw") == "tw-shard1-b"
    assert cfg.shard_path("TW_DELAY") == "/timewheel/TW_DELAY/shard-1-of-3"
