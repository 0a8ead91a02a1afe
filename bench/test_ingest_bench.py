"""Micro benchmark of ingest's Python work per message: a pull answer of 32 stored messages with
200-byte bodies, from its bytes to the store (no broker).

Run: .venv/bin/python -m pytest bench/test_ingest_bench.py --benchmark-only
`extra_info` carries microseconds per message; results with their command in bench/results/.

- general: `decode_messages` → `DelayTopicIngest._store_batch` (`to_message` per message, then
  `Engine.schedule`: validation, `to_record`, `ScheduleStore.append` encoding each record);
- one pass: `OnePass.read` (`forwarder._ingest_pass`) → `DelayTopicIngest._store_answers`
  (`Engine.schedule_encoded`, `ScheduleStore.append_encoded` of the record bytes it wrote);
- one pass, 8 answers a commit: what a busy topic's tick hands over (the pull thread stores every
  answer read together in one commit); against one answer a commit it shows the commit's fixed cost.

Every round stores fresh ids (a new answer is made before it, untimed), so each is a real commit.
"""
from __future__ import annotations

import itertools
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from forwarder._ingest_pass import OnePass
from forwarder.config import RocketMQConfig
from forwarder.contract import ContractLimits
from forwarder.ingest import DelayTopicIngest
from forwarder.rocketmq import decode_messages
from timewheel import Engine, EngineConfig, ManualClock, Message

NOW = 1_800_000_000_000
BATCH = 32
BODY = b"x" * 200
ROUNDS = 400
LIMITS = ContractLimits(max_delay_ms=2 * 365 * 86_400_000, max_body_bytes=4 << 20)
_serial = itertools.count()


class _Sink:
    def send_batch(self, messages: Sequence[Message]) -> list[bool]:
        return [True] * len(messages)


def _stored_message(i: int) -> bytes:
    """One message as a pull answer carries it (V1 magic, IPv4 hosts), as a Java producer sends it."""
    props = (f"TW_TARGET_TOPIC\x01BENCH_OUT\x02TW_DELAY_MS\x013600000\x02UNIQ_KEY\x01{i:032X}\x02"
             "WAIT\x01true\x02TAGS\x01tag\x02").encode()
    topic = b"TW_DELAY"
    host = b"\x7f\x00\x00\x01\x00\x00\x27\x11"
    rest = (struct.pack(">q", NOW) + host + struct.pack(">iq", 0, 0) + struct.pack(">i", len(BODY)) + BODY
            + bytes([len(topic)]) + topic + struct.pack(">h", len(props)) + props)
    head = struct.pack(">iiiiiqqiq", 0, -626843481, 0, 3, 0, i, 4096 + i, 0, NOW) + host
    return struct.pack(">i", len(head) + len(rest)) + head[4:] + rest


def _answer() -> tuple[tuple[bytes], dict[str, Any]]:
    first = next(_serial) * BATCH
    return (b"".join(_stored_message(first + i) for i in range(BATCH)),), {}


@pytest.fixture()
def ingest(tmp_path: Path) -> Iterator[DelayTopicIngest]:
    engine = Engine(EngineConfig(tmp_path / "data"), _Sink(), ManualClock(NOW)).start(background=False)
    ing = DelayTopicIngest(RocketMQConfig(namesrv="127.0.0.1:1"), LIMITS, engine.clock.now_ms, None)  # type: ignore[arg-type]
    ing._schedule, ing._cancel, ing._encoded = engine.schedule, engine.apply_cancels, engine
    ing._accepting.set()
    yield ing
    assert ing.counters["ingested"] > 0 and ing.counters["dead_lettered"] == 0
    engine.stop()


def _per_message(benchmark: Any) -> None:
    benchmark.extra_info["us_per_message"] = round(benchmark.stats.stats.mean / BATCH * 1e6, 2)


def test_ingest_general_path(benchmark: Any, ingest: DelayTopicIngest) -> None:
    """Before: a `ReceivedMessage`, a `Message` and a `Record` per message."""
    def run(body: bytes) -> bool:
        return ingest._store_batch(decode_messages(body, LIMITS.max_body_bytes, "b"))

    benchmark.pedantic(run, setup=_answer, rounds=ROUNDS, warmup_rounds=5)
    assert ingest.counters["ingested"] == (ROUNDS + 5) * BATCH
    _per_message(benchmark)



@pytest.mark.parametrize("compiled", [False, True], ids=["python-walk", "compiled-walk"])
def test_ingest_one_pass(benchmark: Any, ingest: DelayTopicIngest, compiled: bool) -> None:
    """After: the answer walked once into record bytes and the columns the store files them by
    (by the Python walk alone, or with the compiled loop taking the plain messages)."""
    one = OnePass(LIMITS, ingest.now_ms, compiled=compiled)

    def run(body: bytes) -> bool:
        return ingest._store_answers([one.read(body, LIMITS.max_body_bytes, "b")])

    benchmark.pedantic(run, setup=_answer, rounds=ROUNDS, warmup_rounds=5)
    assert ingest.counters["ingested"] == (ROUNDS + 5) * BATCH
    _per_message(benchmark)


MERGED = 8


def test_ingest_one_pass_answers_merged(benchmark: Any, ingest: DelayTopicIngest) -> None:
    """The compiled one pass with MERGED answers stored in one commit."""
    one = OnePass(LIMITS, ingest.now_ms, compiled=True)

    def answers() -> tuple[tuple[list[bytes]], dict[str, Any]]:
        return ([_answer()[0][0] for _ in range(MERGED)],), {}

    def run(bodies: list[bytes]) -> bool:
        return ingest._store_answers([one.read(b, LIMITS.max_body_bytes, "b") for b in bodies])

    benchmark.pedantic(run, setup=answers, rounds=ROUNDS // 4, warmup_rounds=2)
    assert ingest.counters["ingested"] == (ROUNDS // 4 + 2) * BATCH * MERGED
    benchmark.extra_info["us_per_message"] = round(benchmark.stats.stats.mean / (BATCH * MERGED) * 1e6, 2)
