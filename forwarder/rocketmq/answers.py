"""Where the broker stored each message of a send batch, as rows of `storage.ANSWER_DTYPE`.

A SEND_BATCH_MESSAGE answer names the queue (`queueId`), the queue offset of the batch's first
message (the others follow in order) and every message's id (`msgId`, comma-separated): for an
IPv4 store host 32 hex digits, the address, the port and the commit-log offset, big-endian, which
is what `mqadmin queryMsgById` takes. The rows keep those parts, not the text.
"""
from __future__ import annotations

import struct

import numpy as np

__all__ = ["answer_rows"]

#: a broker's message id for an IPv4 store host, as bytes: address, port, commit-log offset (big-endian)
_OFFSET_ID = np.dtype([("ip", "u1", (4,)), ("port", ">u4"), ("offset", ">i8")])
_OFFSET_ID_HEX = 2 * _OFFSET_ID.itemsize
_OFFSET_ID_ROW = struct.Struct(">4sIq")  # the same, one id
assert _OFFSET_ID_ROW.size == _OFFSET_ID.itemsize


def answer_rows(answers: np.ndarray, index: list[int], queue_id: int, first: int, offset_ids: str) -> None:
    """Fill the answer rows of one stored batch (its messages' positions in `index`): queue id and
    offsets follow in order from `first`; each message id (comma-separated in the broker's answer)
    gives its store host and commit-log offset. Ids of another shape (an IPv6 store host) are left
    out: the queue offset still finds the message."""
    n = len(index)
    if n == 1 and first >= 0 and len(offset_ids) == _OFFSET_ID_HEX:  # a send of one message: no array work
        try:
            ip, port, offset = _OFFSET_ID_ROW.unpack(bytes.fromhex(offset_ids))
        except ValueError:
            pass
        else:
            answers[index[0]] = (first, offset, tuple(ip), min(port, 0xFFFF), queue_id)
            return
    _columns(answers, index, queue_id, first, offset_ids)


def _columns(answers: np.ndarray, index: list[int], queue_id: int, first: int, offset_ids: str) -> None:
    """`answer_rows` a column at a time."""
    n = len(index)
    # a batch of one topic is usually a run of positions: a slice then, not a gather
    rows: slice | np.ndarray = slice(index[0], index[-1] + 1) if index[-1] - index[0] + 1 == n else \
        np.asarray(index, np.int64)
    answers["queue_id"][rows] = queue_id
    if first >= 0:
        answers["queue_offset"][rows] = np.arange(first, first + n, dtype=np.int64)
    if len(offset_ids) != n * (_OFFSET_ID_HEX + 1) - 1:
        return
    try:
        ids = np.frombuffer(bytes.fromhex(offset_ids.replace(",", "")), _OFFSET_ID)
    except ValueError:
        return
    answers["store_ip"][rows] = ids["ip"]
    answers["store_port"][rows] = np.minimum(ids["port"], 0xFFFF)
    answers["commit_offset"][rows] = ids["offset"]
