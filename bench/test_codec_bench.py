"""Micro benchmarks of the RocketMQ hot paths: a send batch built from stored records, and a pull
answer decoded, each beside the way it was done before (one object per message at every step).

Run: .venv/bin/python -m pytest bench/test_codec_bench.py --benchmark-only
`extra_info` carries microseconds per message; results with their command in bench/results/.

- read+encode, per message: `read_records` → `Message.from_record` → `to_outgoing` →
  `encode_message` (before), against `read_record_bytes` → `encode_records` (after), for a send
  batch of 256 due records of 200-byte bodies with tags and a key;
- decode: `decode_messages` of a pull answer of 32 stored messages with the contract's properties,
  then `to_message` of each (ingest's per-message work before storing).
"""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from forwarder.contract import ContractLimits, to_message, to_outgoing
from forwarder.record_encoding import encode_records
from forwarder.rocketmq import decode_messages, encode_message
from storage import Record, ScheduleStore
from timewheel.message import Message

NOW = 1_800_000_000_000
BATCH = 256
BODY = b"x" * 200


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory):
    store = ScheduleStore(tmp_path_factory.mktemp("codec") / "data")
    recs = [Record(f"{i:032X}:0badf00d", "BENCH_OUT", BODY, NOW + 10 + i, tags="tag", keys=(f"order-{i}",))
            for i in range(BATCH)]
    locs = store.append(recs, NOW).locations
    yield store, locs
    store.close()


def _per_message(benchmark, n: int) -> None:
    benchmark.extra_info["us_per_message"] = round(benchmark.stats.stats.mean / n * 1e6, 2)


def test_read_and_encode_objects(benchmark, stored) -> None:
    """Before: an object per message at every step."""
    store, locs = stored
    segs, parts, offs, due = (locs["segment_ms"].tolist(), locs["part"].tolist(), locs["offset"].tolist(),
                              locs["due_ms"].tolist())
    ids = [f"{i:032X}" for i in range(BATCH)]

    def run() -> list[bytes]:
        recs = store.read_records(segs, parts, offs, due)
        return [encode_message(to_outgoing(Message.from_record(r, 1)), i)  # type: ignore[arg-type]
                for r, i in zip(recs, ids)]

    out = benchmark(run)
    assert len(out) == BATCH
    _per_message(benchmark, BATCH)


def test_read_and_encode_record_bytes(benchmark, stored) -> None:
    """After: checked record bytes, each message encoded from slices of its record."""
    store, locs = stored
    segs, parts = locs["segment_ms"].astype(np.int64), locs["part"].astype(np.uint16)
    offs, due = locs["offset"].astype(np.uint32), locs["due_ms"].astype(np.int64)
    ids = [f"{i:032X}" for i in range(BATCH)]

    def run() -> list:
        return encode_records(store.read_record_bytes(segs, parts, offs, due), ids)

    out = benchmark(run)
    recs = store.read_records(segs.tolist(), parts.tolist(), offs.tolist(), due.tolist())
    assert out == [encode_message(to_outgoing(Message.from_record(r)), i)  # type: ignore[arg-type]
                   for r, i in zip(recs, ids)]
    _per_message(benchmark, BATCH)


def _stored_message(i: int) -> bytes:
    """One message as a pull answer carries it (V1 magic, IPv4 hosts)."""
    props = (f"TW_TARGET_TOPIC\x01BENCH_OUT\x02TW_DELIVER_AT_MS\x01{NOW + 3_600_000}\x02UNIQ_KEY\x01{i:032X}\x02"
             "WAIT\x01true\x02TAGS\x01tag\x02").encode()
    topic = b"TW_DELAY"
    body = BODY + str(i).encode()
    host = b"\x7f\x00\x00\x01\x00\x00\x27\x11"
    rest = (struct.pack(">q", NOW) + host + struct.pack(">iq", 0, 0) + struct.pack(">i", len(body)) + body
            + bytes([len(topic)]) + topic + struct.pack(">h", len(props)) + props)
    head = struct.pack(">iiiiiqqiq", 0, -626843481, 0, 3, 0, i, 4096 + i, 0, NOW) + host
    return struct.pack(">i", len(head) + len(rest)) + head[4:] + rest


def test_decode_pull_and_check_contract(benchmark) -> None:
    """A pull answer of 32 messages: decoded, then each checked against the producer contract."""
    body = b"".join(_stored_message(i) for i in range(32))
    limits = ContractLimits(max_delay_ms=2 * 365 * 86_400_000, max_body_bytes=4 << 20)

    def run() -> list[Message]:
        return [to_message(m, NOW, limits) for m in decode_messages(body)]

    out = benchmark(run)
    assert len(out) == 32 and out[0].topic == "BENCH_OUT"
    _per_message(benchmark, 32)
