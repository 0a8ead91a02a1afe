"""Micro benchmarks of the RocketMQ hot paths: a send batch built from stored records, and a pull
answer decoded, each beside the way it was done before (one object per message at every step).

Run: .venv/bin/python -m pytest bench/test_codec_bench.py --benchmark-only
`extra_info` carries microseconds per message; results with their command in bench/results/.

- read+encode, per message: `read_records` → `Message.from_record` → `to_outgoing` →
  `encode_message` (before), against `read_record_bytes` → `encode_records` (after), for a send
  batch of 256 due records of 200-byte bodies with tags and a key;
- decode: `decode_messages` of a pull answer of 32 stored messages with the contract's properties,
  then `to_message` of each (ingest's per-message work before storing);
- send body, per message: a SEND_BATCH_MESSAGE body from record bytes already read, for 256 rows
  and for 1: `delivered_ids` → `encode_records` → `cut_encoded` → join (the general path, kept as
  the reference) against `cut_records` (one pass) → join;
- remoting header of a send batch request (encode) and of its answer (decode): the standard
  library's json as the protocol used it before, against orjson as it does now.
"""
from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from typing import TypedDict

import numpy as np
import pytest
from pytest_benchmark.fixture import BenchmarkFixture

from forwarder.contract import ContractLimits, to_message, to_outgoing
from forwarder.record_batches import cut_records
from forwarder.record_encoding import delivered_ids, encode_records
from forwarder.rocketmq import decode_messages, encode_message
from forwarder.rocketmq._send_batch import Outcome, SendBatch, batch_header, cut_encoded
from forwarder.rocketmq.errors import MessageRejectedError
from forwarder.rocketmq.protocol import Response, decode_response, encode_request
from storage import Record, RecordBytes, ScheduleStore
from timewheel.message import Message

NOW = 1_800_000_000_000
BATCH = 256
BODY = b"x" * 200


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ScheduleStore, np.ndarray]]:
    store = ScheduleStore(tmp_path_factory.mktemp("codec") / "data")
    recs = [Record(f"{i:032X}:0badf00d", "BENCH_OUT", BODY, NOW + 10 + i, tags="tag", keys=(f"order-{i}",))
            for i in range(BATCH)]
    locs = store.append(recs, NOW).locations
    yield store, locs
    store.close()


def _per_message(benchmark: BenchmarkFixture, n: int) -> None:
    assert benchmark.stats is not None  # set once the benchmark has run
    benchmark.extra_info["us_per_message"] = round(benchmark.stats.stats.mean / n * 1e6, 2)


def test_read_and_encode_objects(benchmark: BenchmarkFixture, stored: tuple[ScheduleStore, np.ndarray]) -> None:
    """Before: an object per message at every step."""
    store, locs = stored
    segs, parts, offs, due = (locs["segment_ms"].tolist(), locs["part"].tolist(), locs["offset"].tolist(),
                              locs["due_ms"].tolist())
    ids = [f"{i:032X}" for i in range(BATCH)]

    def run() -> list[bytes]:
        recs = store.read_records(segs, parts, offs, due)
        # the records were written just now, none is corrupt: no check in the measured loop
        return [encode_message(to_outgoing(Message.from_record(r, 1)), i)  # type: ignore[arg-type]
                for r, i in zip(recs, ids)]

    out = benchmark(run)
    assert len(out) == BATCH
    _per_message(benchmark, BATCH)


def test_read_and_encode_record_bytes(benchmark: BenchmarkFixture, stored: tuple[ScheduleStore, np.ndarray]) -> None:
    """After: checked record bytes, each message encoded from slices of its record."""
    store, locs = stored
    segs, parts = locs["segment_ms"].astype(np.int64), locs["part"].astype(np.uint16)
    offs, due = locs["offset"].astype(np.uint32), locs["due_ms"].astype(np.int64)
    ids = [f"{i:032X}" for i in range(BATCH)]

    def run() -> list[bytes | MessageRejectedError]:
        return encode_records(store.read_record_bytes(segs, parts, offs, due), ids)

    out = benchmark(run)
    recs = store.read_records(segs.tolist(), parts.tolist(), offs.tolist(), due.tolist())
    assert out == [encode_message(to_outgoing(Message.from_record(r)), i)  # type: ignore[arg-type]  # none corrupt
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


def test_decode_pull_and_check_contract(benchmark: BenchmarkFixture) -> None:
    """A pull answer of 32 messages: decoded, then each checked against the producer contract."""
    body = b"".join(_stored_message(i) for i in range(32))
    limits = ContractLimits(max_delay_ms=2 * 365 * 86_400_000, max_body_bytes=4 << 20)

    def run() -> list[Message]:
        return [to_message(m, NOW, limits) for m in decode_messages(body)]

    out = benchmark(run)
    assert len(out) == 32 and out[0].topic == "BENCH_OUT"
    _per_message(benchmark, 32)


def _rows(stored: tuple[ScheduleStore, np.ndarray], n: int) -> RecordBytes:
    store, locs = stored
    locs = locs[:n]
    return store.read_record_bytes(locs["segment_ms"].astype(np.int64), locs["part"].astype(np.uint16),
                                   locs["offset"].astype(np.uint32), locs["due_ms"].astype(np.int64))


def _fresh(n: int) -> list[str]:
    return ["F" * 32] * n


class _Limits(TypedDict):
    max_message: int
    max_count: int
    max_bytes: int


_LIMITS: _Limits = {"max_message": 4 << 20, "max_count": 256, "max_bytes": 4 << 20}


def _general(raw: RecordBytes) -> list[bytes]:
    """The general path: ids, messages and batches each in a pass of their own, then each batch joined."""
    ids = delivered_ids(raw, _fresh)
    topics = raw.topics()
    out: list[Outcome] = [None] * len(raw)
    batches = cut_encoded(topics, encode_records(raw, ids), ids, {t: object() for t in set(topics)},  # type: ignore[misc]
                          out, **_LIMITS)
    return [b"".join(b.parts) for b in batches]


@pytest.mark.parametrize("n", [1, BATCH])
def test_send_body_general_path(benchmark: BenchmarkFixture, stored: tuple[ScheduleStore, np.ndarray], n: int) -> None:
    """Before: the general path (kept as the reference)."""
    raw = _rows(stored, n)
    assert len(benchmark(_general, raw)) == 1
    _per_message(benchmark, n)


@pytest.mark.parametrize("compiled", [False, True], ids=["python-pass", "compiled-cut"])
@pytest.mark.parametrize("n", [1, BATCH])
def test_send_body_one_pass(benchmark: BenchmarkFixture, stored: tuple[ScheduleStore, np.ndarray], n: int,
                            compiled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """After: `cut_records`, one pass over the rows (in Python, or the plain rows by the compiled
    loop), then each batch joined."""
    from forwarder import record_batches
    if not compiled:
        monkeypatch.setattr(record_batches, "_compiled_cut", None)
    raw = _rows(stored, n)

    def run() -> list[bytes]:
        return [b"".join(b.parts) for b in cut_records(raw, _fresh, **_LIMITS).batches]

    assert benchmark(run) == _general(raw)
    _per_message(benchmark, n)


def _old_encode_request(code: int, opaque: int, ext: dict[str, str], body: bytes) -> bytes:
    """The request encoder as it was, on the standard library's json."""
    header = json.dumps({"code": code, "language": "PYTHON", "version": 479, "opaque": opaque, "flag": 0,
                         "extFields": ext}, separators=(",", ":")).encode()
    return struct.pack(">ii", 4 + len(header) + len(body), len(header)) + header + body


_ANSWER = json.dumps({"code": 0, "extFields": {"msgId": ",".join(f"7F00000100002A9F{i:016X}" for i in range(4)),
                                               "queueId": "3", "queueOffset": "1234", "MSG_REGION": "DefaultRegion",
                                               "TRACE_ON": "true", "transactionId": ""},
                      "flag": 1, "language": "JAVA", "opaque": 12345, "serializeTypeCurrentRPC": "JSON",
                      "version": 479}, separators=(",", ":")).encode()
_ANSWER_FRAME = struct.pack(">i", len(_ANSWER)) + _ANSWER


def _send_header() -> dict[str, str]:
    b = SendBatch("BENCH_OUT")
    b.queue = ("broker-a", 3)
    return batch_header("TW_PRODUCER", b, str(NOW))


@pytest.mark.parametrize("impl", ["json", "orjson"])
def test_header_encode(benchmark: BenchmarkFixture, impl: str) -> None:
    """A SEND_BATCH_MESSAGE request's header, encoded (empty body)."""
    ext = _send_header()
    encode = _old_encode_request if impl == "json" else encode_request
    assert encode(320, 7, ext, b"") == _old_encode_request(320, 7, ext, b"")
    benchmark(encode, 320, 7, ext, b"")


def _old_decode_response(frame: bytes, peer: str) -> Response | None:
    """The response decoder as it was, on the standard library's json."""
    (info,) = struct.unpack_from(">i", frame)
    end = 4 + (info & 0xFFFFFF)
    header = json.loads(frame[4:end])
    if not isinstance(header, dict):
        raise ValueError(peer)
    if not int(header.get("flag", 0)) & 1:
        return None
    return Response(int(header.get("code", 1)), int(header.get("opaque", -1)), header.get("remark"),
                    header.get("extFields") or {}, frame[end:])


@pytest.mark.parametrize("impl", ["json", "orjson"])
def test_header_decode(benchmark: BenchmarkFixture, impl: str) -> None:
    """A broker's answer to a send batch, decoded."""
    decode = _old_decode_response if impl == "json" else decode_response
    assert decode(_ANSWER_FRAME, "broker") == _old_decode_response(_ANSWER_FRAME, "broker")
    benchmark(decode, _ANSWER_FRAME, "broker")
