"""CI form of the kill loop: 3 SIGKILLs of `timewheel serve` under steady load, nothing lost."""
from __future__ import annotations

from pathlib import Path

import pytest

from forwarder.local_rocketmq import LocalRocketMQ
from tests.reliability.kill_loop import run_kill_loop

pytestmark = [pytest.mark.rocketmq, pytest.mark.slow]


def test_three_kills_under_load_lose_nothing_acknowledged(rocketmq: LocalRocketMQ, tmp_path: Path) -> None:
    r = run_kill_loop(rocketmq, 3, tmp_path, rate=200, seed=3)
    print(f"\nkill loop: {r}")
    assert r.acknowledged > 500, "the producer barely ran; the test would prove nothing"
    assert r.lost == 0, r
