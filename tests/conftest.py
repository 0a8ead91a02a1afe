"""Fixtures shared by every test package."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from coordination.local_zookeeper import LocalZooKeeper
from forwarder.local_rocketmq import LocalRocketMQ


@pytest.fixture(scope="session")
def rocketmq() -> Iterator[LocalRocketMQ]:
    """A real Apache RocketMQ (NameServer + Broker on loopback) shared by the whole session."""
    # The store goes away with the temporary run directory, so a graceful stop at the end (10-15 s
    # of broker shutdown hooks) buys nothing: SIGKILL after a short grace period.
    mq = LocalRocketMQ(stop_timeout=3.0)
    mq.start()
    try:
        yield mq
    finally:
        mq.stop()


@pytest.fixture(scope="session")
def zookeeper() -> Iterator[LocalZooKeeper]:
    """A real Apache ZooKeeper (standalone, on loopback) shared by the whole session."""
    zk = LocalZooKeeper().start()
    try:
        yield zk
    finally:
        zk.stop()
