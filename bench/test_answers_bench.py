"""What keeping the broker's answers costs a delivered send batch: parsing them out of the
SEND_BATCH answer and writing the dispatch frame with them (TWD3), against the plain frame (TWD2).

Run: .venv/bin/python -m pytest bench/test_answers_bench.py --benchmark-only
A batch is 128 messages, as the delivery sink sends them; divide by 128 for a message.
"""
from __future__ import annotations

import numpy as np
import pytest
from pytest_benchmark.fixture import BenchmarkFixture

from forwarder.rocketmq.answers import answer_rows
from storage import DELIVERED, dispatch_entries, encode_frame, no_answers

N = 128
IDS = ",".join(f"7F00000100002A9F{i * 180:016X}" for i in range(N))  # as a broker on 127.0.0.1:10911 answers
ENTRIES = dispatch_entries(0, np.arange(N, dtype=np.uint32) * 180, np.zeros(N, np.int64), 1, DELIVERED, 1)


def _with_answers() -> bytes:
    answers = no_answers(N)
    answer_rows(answers, list(range(N)), 1, 1000, IDS)
    return encode_frame(ENTRIES, 1, answers)


@pytest.mark.parametrize("kind", ["plain", "with_answers"])
def test_a_send_batchs_dispatch_frame(benchmark: BenchmarkFixture, kind: str) -> None:
    frame = benchmark(_with_answers if kind == "with_answers" else (lambda: encode_frame(ENTRIES, 1)))
    assert len(frame) == 24 * (1 + (2 if kind == "with_answers" else 1) * N)
    benchmark.extra_info["messages_per_round"] = N
