"""CI form of the segment churn soak: one-minute segments retired 36 s after they end, for about
2 minutes under steady load through a real RocketMQ, the engine killed (SIGKILL) and started again
about every 40 s (tests/reliability/segment_churn.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from forwarder.local_rocketmq import LocalRocketMQ
from tests.reliability.segment_churn import run_churn, table

pytestmark = [pytest.mark.rocketmq, pytest.mark.slow]


def test_retired_segments_leave_no_file_held_and_every_message_arrives_once(rocketmq: LocalRocketMQ,
                                                                            tmp_path: Path) -> None:
    r = run_churn(rocketmq, 130, tmp_path, rate=150, max_delay_s=20, sample_every_s=5, kill_every_s=40)
    print(f"\nsegment churn:\n{table(r)}")
    assert r.acknowledged > 10_000, "the producer barely ran; the test would prove nothing"
    assert r.kills >= 2, r.kills
    assert not r.problems, r.problems
