"""Zero duplicates under faults (tests/forwarder/dedupe_harness.py): one round of each fault kind on
a RocketMQ of two brokers and a ZooKeeper, each round's engine killed or stopped by its fault hook
between a send and its record; an independent read of both target topics from offset 0 must find
every acknowledged message exactly once, with look-ups that found copies and look-ups that led to
a re-send.

The CI form runs five rounds (about three minutes); `TIMEWHEEL_DEDUPE_ROUNDS=N` runs N rounds of
every kind in turn (`python -m bench.zero_dups --rounds 50` is the long form, printing the table).
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordination import LocalZooKeeper
from forwarder.local_rocketmq import LocalRocketMQ
from tests.forwarder.dedupe_harness import BROKER_OPTIONS, FAULTS, rounds_of, run

pytestmark = [pytest.mark.rocketmq, pytest.mark.slow]


@pytest.fixture(scope="module")
def two_brokers() -> Iterator[LocalRocketMQ]:
    """A RocketMQ of two masters (broker-a, broker-b) under one NameServer, for this module only."""
    mq = LocalRocketMQ(brokers=2, stop_timeout=3.0, broker_options=BROKER_OPTIONS)
    mq.start()
    try:
        yield mq
    finally:
        mq.stop()


def test_faults_leave_neither_losses_nor_duplicates(two_brokers: LocalRocketMQ, zookeeper: LocalZooKeeper,
                                                     tmp_path: Path) -> None:
    n = os.environ.get("TIMEWHEEL_DEDUPE_ROUNDS")
    report = run(two_brokers, zookeeper, tmp_path, rounds_of(int(n) if n else len(FAULTS)))
    print("\n" + report.table() + f"\n{report.totals}")
    assert report.failures == []
