"""The broker's answer to a SEND_BATCH_MESSAGE, as rows of the dispatch log's answers."""
from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from forwarder.rocketmq.answers import _columns, answer_rows
from storage import broker_message_ids, no_answers

# ids as a 5.x broker on 127.0.0.1:10911 answers them for three messages at commit-log offsets 0x100, 0x1A0, 0x240
IDS = "7F00000100002A9F0000000000000100,7F00000100002A9F00000000000001A0,7F00000100002A9F0000000000000240"


@pytest.mark.parametrize("index", [[0, 1, 2], [1, 3, 4]], ids=["a run of positions", "positions apart"])
def test_each_message_gets_its_queue_offset_and_message_id(index: list[int]) -> None:
    answers = no_answers(5)
    answer_rows(answers, index, 3, 70, IDS)
    assert answers["queue_offset"][index].tolist() == [70, 71, 72]
    assert answers["queue_id"][index].tolist() == [3, 3, 3]
    assert [broker_message_ids(answers)[i] for i in index] == IDS.split(",")
    others = [i for i in range(5) if i not in index]
    assert answers["queue_offset"][others].tolist() == [-1, -1]


def test_ids_of_another_shape_keep_the_queue_offsets_only() -> None:
    answers = no_answers(2)
    ipv6 = "00000000000000000000FFFF7F00000100002A9F0000000000000100"  # 16-byte address: 56 digits
    answer_rows(answers, [0, 1], 0, 5, f"{ipv6},{ipv6}")
    assert answers["queue_offset"].tolist() == [5, 6]
    assert broker_message_ids(answers) == ["", ""]


@given(st.integers(0, 65535), st.integers(-1, 2**40), st.binary(min_size=4, max_size=4), st.integers(0, 2**32 - 1),
       st.integers(0, 2**63 - 1), st.integers(0, 3), st.sampled_from(["", "upper", "lower", "short", "bad"]))
def test_one_message_answer_is_the_column_paths_row(queue_id: int, first: int, ip: bytes, port: int, offset: int,
                                                     row: int, shape: str) -> None:
    """The answer to a send of one message is filled without array work: the same row as the columns."""
    text = (ip + struct.pack(">I", port) + struct.pack(">q", offset)).hex()
    ids = {"": "", "upper": text.upper(), "lower": text, "short": text[:-2], "bad": "Z" + text[1:]}[shape]
    fast, columns = no_answers(4), no_answers(4)
    answer_rows(fast, [row], queue_id, first, ids)
    _columns(columns, [row], queue_id, first, ids)
    assert fast.tobytes() == columns.tobytes()
