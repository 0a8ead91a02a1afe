"""Ingest's one pass (`forwarder._ingest_pass`) against the general path, under hypothesis: for any
pull answers, the same records, index, origins and meta entries on disk, the same messages routed
to the general path as the codec reads them, and the same dead letters and counters."""
from __future__ import annotations

import os
import struct
import time
import uuid
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import lz4.frame
import pytest
import zstandard
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import forwarder._ingest_pass as ingest_pass
from forwarder._ingest_pass import COMPILED, OnePass, PulledAnswer
from forwarder.config import RocketMQConfig
from forwarder.contract import ContractLimits
from forwarder.ingest import DelayTopicIngest
from forwarder.local_rocketmq import LocalRocketMQ
from forwarder.rocketmq import MessageDecodeError, OutgoingMessage, ReceivedMessage, RemotingPullConsumer
from forwarder.rocketmq.consumer import BodyReader
from forwarder.rocketmq.codec import decode_messages
from forwarder.rocketmq.compression import InflateBudget
from timewheel import Engine, EngineConfig, ManualClock, Message

NOW = 1_800_000_000_000
HOUR = 3_600_000
MAX_DELAY = 6 * HOUR
MAX_BODY = 2048
#: the engine's own limits are a little tighter than the contract's: rows it refuses are dead-lettered
ENGINE_MAX_DELAY = MAX_DELAY - 1000
ENGINE_MAX_BODY = MAX_BODY - 48
LIMITS = ContractLimits(MAX_DELAY, MAX_BODY, frozenset({"TW_DELAY", "TW_DLQ"}))
COMMIT_BUDGET = 8 * 1024
_V1, _V2 = -626843481, -626843477


class _Sink:
    def send_batch(self, messages: Sequence[Message]) -> list[bool]:
        return [False] * len(messages)


class _Dlq:
    def __init__(self) -> None:
        self.sent: list[OutgoingMessage] = []

    def send_batch(self, topic: str, messages: list[OutgoingMessage]) -> list[Any]:
        self.sent.extend(messages)
        return []


def _ingest(engine: Engine, one_pass: bool) -> tuple[DelayTopicIngest, _Dlq]:
    dlq = _Dlq()
    ing = DelayTopicIngest(RocketMQConfig(namesrv="127.0.0.1:1", dead_letter_topic="TW_DLQ"), LIMITS,
                           engine.clock.now_ms, dlq)  # type: ignore[arg-type]
    ing._schedule, ing._cancel = engine.schedule, engine.apply_cancels
    ing._encoded = engine if one_pass else None
    ing._accepting.set()
    return ing, dlq


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Engine, Engine]]:
    engines = [Engine(EngineConfig(tmp_path_factory.mktemp(name), max_delay_ms=ENGINE_MAX_DELAY,
                                   max_body_bytes=ENGINE_MAX_BODY), _Sink(), ManualClock(NOW)).start(background=False)
               for name in ("general", "one-pass")]
    try:
        yield engines[0], engines[1]
    finally:
        for e in engines:
            e.stop()


# ---- pull answers: mostly delay messages a producer would send, and every kind of unusual one -----

_text = st.text(st.characters(blacklist_categories=["Cs"]), max_size=8)
_name = st.one_of(st.sampled_from(["p", "Zoë", "名", "x-y", "__RMQ.TRANSIENT.t", "CLUSTER", "TW_DUE_MS",
                                   "TW_ORIGINAL_MSG_ID", "TW_DEAD_LETTER_REASON"]), _text.filter(bool))
_value = st.one_of(_text, st.sampled_from(["", "\x00", "\ufffd", "a\x01b", "v" * 32_600, "v" * 31_000]))
_target = st.one_of(st.sampled_from(["ORDERS", "t-1", "P_2"] * 6 + ["bad topic", "%DLQ%x", "TW_DELAY", "", " ORDERS",
                                                                     "ü", "x" * 128, "SCHEDULE_TOPIC_XXXX"]))
_delay = st.one_of(st.integers(0, 2 * HOUR), st.sampled_from([MAX_DELAY - 1000, MAX_DELAY - 999, MAX_DELAY,
                                                              MAX_DELAY + 1, MAX_DELAY + 10]))
_odd_millis = st.sampled_from(["", " 5", "5 ", "-1", "007", "1e3", "٣", "9" * 19, "9" * 18, "0", "+5"])


@st.composite
def _due(draw: st.DrawFn, born: int) -> dict[str, str]:
    out: dict[str, str] = {}
    for name in draw(st.lists(st.sampled_from(["TW_DELAY_MS", "TW_DELIVER_AT_MS", "__STARTDELIVERTIME"]),
                              min_size=draw(st.sampled_from([1, 1, 1, 0])), max_size=2, unique=True)):
        if draw(st.integers(0, 7)) == 0:
            out[name] = draw(_odd_millis)
        else:
            delay = draw(_delay)
            start = (born if born > 0 else NOW) if name == "TW_DELAY_MS" else NOW
            out[name] = str(delay if name == "TW_DELAY_MS" else start + delay - draw(st.sampled_from([0, 0, 5000])))
    return out


_clean = st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00\x01\x02\ufffd"), max_size=8)


_clean_ascii = st.text(st.characters(min_codepoint=3, max_codepoint=127), max_size=8)


@st.composite
def _common(draw: st.DrawFn, born: int) -> bytes:
    """The properties of a delay message as producers send them: any text (often ASCII only, as
    the compiled loop takes it), nothing unusual."""
    text = draw(st.sampled_from([_clean, _clean_ascii]))
    props = {"TW_TARGET_TOPIC": draw(st.sampled_from(["ORDERS", "t-1", "P_2"]))}
    name = draw(st.sampled_from(["TW_DELAY_MS", "TW_DELIVER_AT_MS", "__STARTDELIVERTIME"]))
    delay = draw(_delay)
    props[name] = str(delay if name == "TW_DELAY_MS" else NOW + delay)
    if draw(st.integers(0, 3)):
        props["UNIQ_KEY"] = draw(st.integers(0, 2**128 - 1).map("{:032X}".format))
    if draw(st.booleans()):
        props["TAGS"] = draw(text)
    if draw(st.booleans()):
        props["KEYS"] = draw(st.one_of(text, st.sampled_from(["k1", "k1 k2", "k1  k2", " k2 "])))
    props["WAIT"] = "true"
    for _ in range(draw(st.integers(0, 3))):
        props[draw(text.filter(bool))] = draw(st.one_of(text, st.just("v" * 31_000)))
    return "".join(f"{k}\x01{v}\x02" for k, v in props.items()).encode()[:32_767]


@st.composite
def _properties(draw: st.DrawFn, born: int) -> bytes:
    if draw(st.integers(0, 2)):
        return draw(_common(born))
    props: dict[str, str] = {}
    if draw(st.integers(0, 9)):
        props["TW_TARGET_TOPIC"] = draw(_target)
    props.update(draw(_due(born)))
    if draw(st.integers(0, 3)):
        props["UNIQ_KEY"] = draw(st.one_of(st.integers(0, 2**128 - 1).map("{:032X}".format), st.just(""), _text))
    if draw(st.booleans()):
        props["TAGS"] = draw(st.one_of(st.just("tag"), _text))
    if draw(st.booleans()):
        props["KEYS"] = draw(st.one_of(st.sampled_from(["k1", "k1 k2", "k1  k2", " ", "k\tx", "名 Zoë"]), _text))
    if draw(st.integers(0, 12)) == 0:
        props[draw(st.sampled_from(["TW_CANCEL_ID", "TW_CANCEL_KEY"]))] = draw(st.sampled_from(["k1", "k2", "x y"]))
    props["WAIT"] = "true"
    for _ in range(draw(st.integers(0, 3))):
        props[draw(_name)] = draw(_value)
    text = "".join(f"{k}\x01{v}\x02" for k, v in props.items())
    fault = draw(st.integers(0, 19))
    if fault == 0:  # a property repeated
        text += draw(st.sampled_from(["UNIQ_KEY\x01AB\x02", "p\x01again\x02", "TW_DELAY_MS\x0112\x02"]))
    elif fault == 1:  # the last one not terminated
        text = text[:-1]
    elif fault == 2:  # a pair without a separator
        text += "lonely\x02"
    elif fault in (4, 5):  # as a broker stores a batch's message: WAIT again, with the same value
        text += "MSG_REGION\x01DefaultRegion\x02CLUSTER\x01DefaultCluster\x02WAIT\x01true\x02TRACE_ON\x01true\x02"
    elif fault in (6, 7):  # from RocketMQ's Java client's batch: the batch's own UNIQ_KEY among them
        text += ("MSG_REGION\x01DefaultRegion\x02UNIQ_KEY\x01" + draw(st.sampled_from(["FD00B1", "", "AB"]))
                 + "\x02CLUSTER\x01DefaultCluster\x02WAIT\x01true\x02TRACE_ON\x01true\x02")
    raw = text.encode("utf-8", "surrogatepass")
    if fault == 3:
        raw += b"\xff\xfe\x02"
    return raw[:32_767]


def _compress(codec: int, body: bytes) -> bytes:
    if codec in (0, 3):
        return zlib.compress(body)
    if codec == 1:
        return lz4.frame.compress(body)
    return zstandard.ZstdCompressor().compress(body)


def stored_message(props: bytes, payload: bytes, sys_flag: int, offset: int, *, born: int, topic: bytes = b"TW_DELAY",
                   v2: bool = False, stored: int = NOW - 5) -> bytes:
    """The bytes a broker's store (and so a pull answer) holds for one message."""
    born_host = b"\x7f\x00\x00\x01\x00\x00\x10\x00" if not sys_flag & 0x10 else b"\x00" * 20
    store_host = b"\x0a\x00\x00\x02\x00\x00\x27\x11" if not sys_flag & 0x20 else b"\x01" * 20
    rest = (struct.pack(">q", stored) + store_host + struct.pack(">iq", 0, 0) + struct.pack(">i", len(payload))
            + payload + (struct.pack(">h", len(topic)) if v2 else bytes([len(topic)])) + topic
            + struct.pack(">h", len(props)) + props)
    first = struct.pack(">iiiiiqqiq", 0, _V2 if v2 else _V1, 0, 1, 0, offset, 4096 + offset, sys_flag, born) + born_host
    return struct.pack(">i", len(first) + len(rest)) + first[4:] + rest


@st.composite
def _stored(draw: st.DrawFn, offset: int) -> bytes:
    born = draw(st.sampled_from([NOW - 10, NOW - 10, NOW - 10, 0, -5]))
    body = draw(st.one_of(st.binary(max_size=300), st.binary(max_size=300), st.sampled_from([b"", b"z" * (ENGINE_MAX_BODY + 1), b"z" * MAX_BODY,
                                                                    b"z" * (MAX_BODY + 1)])))
    codec = draw(st.sampled_from([None] * 12 + [0, 1, 2, 3, 5]))
    payload = body if codec is None else (_compress(codec, body) if codec != 5 else body)
    sys_flag = (0 if codec is None else 1 | codec << 8) | draw(st.sampled_from([0, 0, 0x10, 0x20, 0x30]))
    topic = draw(st.sampled_from([b"TW_DELAY"] * 9 + [b"\xff\xfe"]))
    return stored_message(draw(_properties(born)), payload, sys_flag, offset, born=born, topic=topic,
                          v2=draw(st.booleans()), stored=draw(st.sampled_from([NOW - 5, NOW - 5, 0])))


@st.composite
def _pull_answer(draw: st.DrawFn, first: int) -> bytes:
    raw = b"".join(draw(_stored(first + i)) for i in range(draw(st.integers(1, 8))))
    if draw(st.sampled_from([False] * 19 + [True])):  # a framing fault
        raw = raw[:draw(st.integers(0, len(raw)))]
    return raw


@st.composite
def _answers(draw: st.DrawFn) -> list[bytes]:
    return [draw(_pull_answer(100 * i)) for i in range(draw(st.integers(1, 3)))]


# ---- the two paths ---------------------------------------------------------------------------------

def _read_both(bodies: list[bytes]) -> tuple[list[ReceivedMessage], list[PulledAnswer]]:
    """Each body read as the codec reads it and in one pass, under one commit budget each; checks
    that the one pass routes to the general path exactly the codec's messages, and fails alike."""
    general_budget, pass_budget = InflateBudget(COMMIT_BUDGET), InflateBudget(COMMIT_BUDGET)
    one = OnePass(LIMITS, lambda: NOW)
    flat: list[ReceivedMessage] = []
    answers: list[PulledAnswer] = []
    for body in bodies:
        try:
            decoded = decode_messages(body, MAX_BODY, "b", general_budget)
        except MessageDecodeError as e:
            with pytest.raises(MessageDecodeError) as got:
                one.read(body, MAX_BODY, "b", pass_budget)
            assert (str(got.value), got.value.decoded, got.value.raw) == (str(e), e.decoded, e.raw)
            event("a framing fault")
            decoded = e.decoded
            answer = PulledAnswer.of_messages(decoded, "b", MAX_BODY)
        else:
            answer = one.read(body, MAX_BODY, "b", pass_budget)
        assert len(answer) == len(decoded)
        assert answer.unreadable() == [m.undecodable for m in decoded if m.undecodable]
        if decoded:
            assert answer.last_offset() == decoded[-1].queue_offset
        assert answer.general == [decoded[i] for i in answer.general_at]
        assert (pass_budget.remaining, pass_budget.taken, pass_budget.stopped) == (
            general_budget.remaining, general_budget.taken, general_budget.stopped)
        pass_budget.stopped = general_budget.stopped = False
        event(f"one-pass rows: {min(len(answer.rows), 3)}{'+' if len(answer.rows) > 3 else ''}")
        flat += decoded
        answers.append(answer)
    return flat, answers


def _files(engine: Engine) -> dict[str, bytes]:
    """Every file of the engine's data directory but the meta store's, by relative path."""
    root = Path(engine.config.data_dir)
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and "meta" not in p.relative_to(root).parts}


def _meta(engine: Engine) -> dict[bytes, bytes]:
    assert engine.store is not None
    out: dict[bytes, bytes] = {}
    for k, v in engine.store.meta._db.items():
        assert isinstance(k, bytes) and isinstance(v, bytes)  # the meta store is in raw mode
        out[k] = v
    return out


def _letters(dlq: _Dlq) -> list[str]:
    """The dead letters sent, in any order (refusals by the engine may come in another)."""
    return sorted(repr((m.topic, m.body, m.tags, m.keys, sorted(m.properties.items()))) for m in dlq.sent)


@settings(max_examples=int(os.environ.get("TIMEWHEEL_PASS_EXAMPLES", "80")), deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example,
                                 HealthCheck.function_scoped_fixture])
@given(_answers())
def test_one_pass_stores_and_dead_letters_exactly_what_the_general_path_does(pair: tuple[Engine, Engine],
                                                                               bodies: list[bytes]) -> None:
    general, one_pass = pair
    flat, answers = _read_both(bodies)
    g_ing, g_dlq = _ingest(general, one_pass=False)
    p_ing, p_dlq = _ingest(one_pass, one_pass=True)
    assert g_ing._on_batch(flat) is True
    assert p_ing._on_answers([a for a in answers if len(a)]) is True
    event(f"stored in one pass: {min(p_ing.counters.pop('one_pass'), 4)}")
    g_ing.counters.pop("one_pass")
    assert p_ing.counters == g_ing.counters
    assert _letters(p_dlq) == _letters(g_dlq)
    assert one_pass.stats().counters == general.stats().counters
    assert _files(one_pass) == _files(general)
    assert _meta(one_pass) == _meta(general)


def _read_one(one: OnePass, body: bytes) -> PulledAnswer | tuple[str, list[ReceivedMessage], bytes]:
    try:
        return one.read(body, MAX_BODY, "b", InflateBudget(COMMIT_BUDGET))
    except MessageDecodeError as e:
        return str(e), e.decoded, e.raw


@settings(max_examples=int(os.environ.get("TIMEWHEEL_PASS_EXAMPLES", "80")) * 3, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
@given(_answers())
def test_the_compiled_walk_reads_every_answer_as_the_python_walk_does(bodies: list[bytes]) -> None:
    """Rows (record bytes, ids, due times, keys, queues, offsets), general messages and faults alike,
    whether the compiled loop (forwarder/_ingest_walk.pyx) takes a message or leaves it."""
    assert COMPILED, "forwarder/_ingest_walk.pyx was not built: run `make setup` again and read its warnings"
    # targets checked already, as in a running engine: the loop takes them
    taken = _alike(bodies, ("ORDERS", "t-1", "P_2"))
    event(f"taken by the compiled loop: {min(taken, 4)}{'+' if taken > 4 else ''}")


def _alike(bodies: list[bytes], targets: tuple[str, ...]) -> int:
    """Check that both walks read each of `bodies` alike (record bytes and every column), one pair
    of walks for all of them; return how many messages the compiled loop took."""
    compiled, python = OnePass(LIMITS, lambda: NOW), OnePass(LIMITS, lambda: NOW, compiled=False)
    for target in targets:
        compiled._target(target)
    walk, taken = ingest_pass._compiled_walk, 0
    assert walk is not None

    def counting(*args: Any) -> tuple[int, int, int]:
        nonlocal taken
        got = walk(*args)
        taken += got[1]
        return got

    compiled._compiled = counting
    for body in bodies:
        assert _read_one(compiled, body) == _read_one(python, body)
    return taken


def _taken_alike(body: bytes) -> int:
    """How many of `body`'s messages the compiled loop took, after checking that both walks read
    `body` alike."""
    return _alike([body], ("ORDERS", "t-1"))


def _on_queue(raw: bytes, queue: int) -> bytes:
    """A stored message moved to another queue id (big-endian at byte 12)."""
    return raw[:12] + struct.pack(">i", queue) + raw[16:]


_CONTRACT = (("TW_TARGET_TOPIC", "ORDERS"), ("TW_DELAY_MS", "5"))
#: what follows the contract in a message the compiled loop takes: each way it writes the id, the
#: keys and the carried properties
_TAILS = {
    "several keys": (("KEYS", "k1 k2  k3 "), ("TAGS", "t"), ("UNIQ_KEY", "A" * 32)),
    "keys all spaces": (("KEYS", "   "),),
    "more spaces among the keys than room before the body": (("KEYS", " " * 300 + "k"), ("x", "y")),
    "tags and keys empty": (("TAGS", ""), ("KEYS", "")),
    "nothing carried": (("UNIQ_KEY", "B" * 32), ("WAIT", "true")),
    "UNIQ_KEY empty": (("UNIQ_KEY", ""), ("p", "v")),
    "many carried, out of order": tuple((n, f"v{i}") for i, n in enumerate(
        ["zz", "p", "pa", "p0", "B", "_", "a" * 40, "__RMQ.TRANSIENT.x", "m", "qqq", "a", "", "Pa", "p\t", "~"])),
    "carried values empty and long": (("e", ""), ("long", "w" * 3000), ("KEYS", "k")),
}


@pytest.mark.parametrize("tail", list(_TAILS), ids=list(_TAILS))
@pytest.mark.parametrize("payload", [b"", b"body", bytes(range(256)) * 4], ids=["empty", "short", "1KiB"])
@pytest.mark.parametrize("sys_flag", [0, 0x30], ids=["v4", "v6"])
def test_the_compiled_walk_writes_each_kind_of_message_as_the_python_walk_does(tail: str, payload: bytes,
                                                                               sys_flag: int) -> None:
    """Each way the compiled loop writes a record's id, keys and carried properties, those hypothesis
    seldom draws among them (the CRC's input apart from the record, many carried pairs to sort)."""
    props = "".join(f"{k}\x01{v}\x02" for k, v in _CONTRACT + _TAILS[tail]).encode()
    raw = stored_message(props, payload, sys_flag, 7, born=NOW - 10, v2=sys_flag != 0)
    assert _taken_alike(raw * 2) == 2


def test_the_compiled_walk_remembers_nothing_wrong_from_the_message_before() -> None:
    """Names, targets and queues it looked up for one message and reuses for the next: a name of
    the same length in the same place, another target, another queue are each looked up again."""
    def message(offset: int, queue: int, *pairs: tuple[str, str]) -> bytes:
        props = "".join(f"{k}\x01{v}\x02" for k, v in pairs).encode()
        return _on_queue(stored_message(props, b"b%d" % offset, 0, offset, born=NOW - 10), queue)

    body = b"".join((
        message(0, 1, ("TW_TARGET_TOPIC", "ORDERS"), ("TW_DELAY_MS", "5"), ("TAGS", "x"), ("n1", "v")),
        message(1, 1, ("TW_TARGET_TOPIC", "t-1"), ("TW_DELAY_MS", "6"), ("TAGZ", "x"), ("n1", "w")),
        message(2, 2, ("TW_TARGET_TOPIC", "ORDERS"), ("TW_DELAY_MS", "7"), ("TAGS", "y"), ("KEYS", "k")),
        message(3, 1, ("TW_TARGET_TOPIC", "ORDERS"), ("TW_DELIVER_AT_MS", str(NOW + 9)), ("KEYS", "k"), ("n1", "v")),
        message(4, 2, ("TW_TARGET_TOPIC", "ORDERX"), ("TW_DELAY_MS", "5")),  # not checked yet: the Python walk's
        message(5, 2, ("TW_TARGET_TOPIC", "ORDERS"), ("TW_DELAY_MS", "5"), ("n1", "v"), ("n1", "v")),  # repeated
        message(6, 3, ("TW_TARGET_TOPIC", "ORDERS"), ("TW_DELAY_MS", "5"), ("TW_CANCEL_KEY", "k")),  # a cancel
        message(7, 3, ("TW_TARGET_TOPIC", "t-1"), ("TW_DELAY_MS", "5"), ("TAGS", "x"), ("n1", "v")),
    ))
    assert _taken_alike(body) == 5


def test_a_common_message_takes_the_one_pass_and_an_unusual_one_the_general_path() -> None:
    def props(**p: str) -> bytes:
        return "".join(f"{k}\x01{v}\x02" for k, v in p.items()).encode()
    common = stored_message(props(TW_TARGET_TOPIC="ORDERS", TW_DELAY_MS="5", UNIQ_KEY="A" * 32, Zoë="名", KEYS="a b"),
                            b"body", 0, 0, born=NOW - 10)
    compressed = stored_message(props(TW_TARGET_TOPIC="ORDERS", TW_DELAY_MS="5"), zlib.compress(b"b"), 1, 1,
                                born=NOW - 10)
    cancel = stored_message(props(TW_CANCEL_KEY="k"), b"c", 0, 2, born=NOW - 10)
    bad = stored_message(props(TW_TARGET_TOPIC="%DLQ%x", TW_DELAY_MS="5"), b"d", 0, 3, born=NOW - 10)
    answer = OnePass(LIMITS, lambda: NOW).read(common * 2 + compressed + cancel + bad, MAX_BODY, "b")
    assert len(answer) == 5 and len(answer.rows) == 2 and answer.general_at == [2, 3, 4]
    assert answer.rows.queues == ["b:1", "b:1"] and answer.rows.keys == [("a", "b"), ("a", "b")]
    assert answer.received(1) == decode_messages(common, MAX_BODY, "b")[0]


def test_a_message_of_a_java_clients_batch_takes_the_one_pass_under_its_own_id() -> None:
    """As a broker stores it: the batch's properties after the message's own, among them WAIT again
    and the batch's UNIQ_KEY; the message keeps its own (the first), as `split_properties` reads it."""
    text = ("TW_TARGET_TOPIC\x01ORDERS\x02TW_DELAY_MS\x015\x02UNIQ_KEY\x01" + "A" * 32 + "\x02WAIT\x01true\x02"
            "MSG_REGION\x01DefaultRegion\x02UNIQ_KEY\x01" + "B" * 32 + "\x02WAIT\x01true\x02TRACE_ON\x01true\x02")
    raw = stored_message(text.encode(), b"body", 0, 0, born=NOW - 10)
    answer = OnePass(LIMITS, lambda: NOW).read(raw, MAX_BODY, "b")
    assert len(answer.rows) == 1 and not answer.general
    assert answer.rows.msg_ids[0].startswith("A" * 32 + ":")
    assert decode_messages(raw, MAX_BODY, "b")[0].msg_id == "A" * 32


@pytest.mark.rocketmq
def test_a_consumer_reading_in_one_pass_keeps_the_commit_budget_and_loses_nothing(rocketmq: LocalRocketMQ) -> None:
    """From a real broker: ordinary delay messages arrive as record rows, compressed ones (1 MiB
    each, a few KB as stored) on the general path, a couple per commit under its inflate budget;
    every offset once."""
    from forwarder._rmq_native import NativeProducer

    topic, group = f"PASS_{uuid.uuid4().hex[:8]}", f"pass-group-{uuid.uuid4().hex[:8]}"
    rocketmq.create_topics([topic], queues=1)
    contract = {"TW_TARGET_TOPIC": "ORDERS", "TW_DELAY_MS": "1000", "Zoë": "名"}
    with NativeProducer(f"pass-producer-{uuid.uuid4().hex[:8]}", rocketmq.namesrv_addr) as p:
        for i in range(8):
            body = bytes([65 + i]) * (1 << 20) if i % 2 else f"small-{i}".encode()
            p.send(OutgoingMessage(topic, body, "tag", f"k{i}", contract))
    commits: list[tuple[list[int], list[int]]] = []  # per commit: offsets read in one pass, offsets general

    def collect(answers: list[PulledAnswer]) -> bool:
        commits.append(([o for a in answers for o in a.rows.offsets],
                        [m.queue_offset for a in answers for m in a.general]))
        assert all(m.undecodable is None and len(m.body) == 1 << 20 for a in answers for m in a.general)
        return True
    limits = ContractLimits(HOUR, 2 << 20)
    c = RemotingPullConsumer(rocketmq.namesrv_addr, group, topic, collect, rebalance_interval_s=0.5,
                             max_body_bytes=2 << 20, max_commit_inflated_bytes=2 << 20,
                             reader=BodyReader(OnePass(limits, lambda: int(time.time() * 1000)).read,
                                               PulledAnswer.of_messages))
    c.start()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and sum(len(f) + len(g) for f, g in commits) < 8:
            time.sleep(0.05)
    finally:
        c.stop()
    assert sorted(o for f, g in commits for o in f + g) == list(range(8)), commits
    assert sorted(o for f, _ in commits for o in f) == [0, 2, 4, 6], commits
    assert max(len(g) for _, g in commits) <= 3, commits
