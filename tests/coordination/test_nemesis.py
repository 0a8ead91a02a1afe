"""Faults round after round against one shard of two real replicas (tests/coordination/nemesis.py).

The CI form runs one round of each fault kind (about three minutes); `TIMEWHEEL_NEMESIS_ROUNDS=N`
runs N rounds of every kind in turn (`python -m bench.nemesis --rounds 24` is the long form, with
its own RocketMQ and ZooKeeper, printing the table).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from coordination import LocalZooKeeper
from forwarder.local_rocketmq import LocalRocketMQ
from tests.coordination.nemesis import FAULTS, rounds_of, run

pytestmark = [pytest.mark.rocketmq, pytest.mark.slow]



def test_faults_lose_nothing_and_stay_within_the_stated_bounds(rocketmq: LocalRocketMQ, zookeeper: LocalZooKeeper,
                                                               tmp_path: Path) -> None:
    n = os.environ.get("TIMEWHEEL_NEMESIS_ROUNDS")
    faults = rounds_of(int(n) if n else len(FAULTS))
    report = run(rocketmq, zookeeper, tmp_path, faults)
    print("\n" + report.table() + f"\n{report.totals}\n" + "\n".join(report.cancelled_delivered))
    assert report.failures == []
