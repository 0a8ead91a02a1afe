"""The broker each conformance test runs against: RocketMQ 5 (the session's broker) in every run, and
the newest 4.9 release as well in the slow suite (`-m slow`; CI runs it too)."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from forwarder._local_distribution import LEGACY_ROCKETMQ_VERSION, ROCKETMQ_VERSION
from forwarder.local_rocketmq import LocalRocketMQ

VERSIONS = [pytest.param(ROCKETMQ_VERSION, id=ROCKETMQ_VERSION),
            pytest.param(LEGACY_ROCKETMQ_VERSION, id=LEGACY_ROCKETMQ_VERSION, marks=pytest.mark.slow)]


@pytest.fixture(scope="package")
def legacy_rocketmq() -> Iterator[LocalRocketMQ]:
    """A RocketMQ 4.9 NameServer and broker (started on first use, shared by the conformance tests;
    stopped after them, so that its idle work does not slow the rest of the session)."""
    mq = LocalRocketMQ(stop_timeout=3.0, version=LEGACY_ROCKETMQ_VERSION)
    mq.start()
    try:
        yield mq
    finally:
        mq.stop()


@pytest.fixture(params=VERSIONS)
def broker(request: pytest.FixtureRequest) -> LocalRocketMQ:
    """The local RocketMQ of the version the test is parametrized with."""
    fixture = "rocketmq" if request.param == ROCKETMQ_VERSION else "legacy_rocketmq"
    mq: LocalRocketMQ = request.getfixturevalue(fixture)
    return mq
