"""The rows of the brokers that served each target topic: `[broker, topic, ...]`, one broker a row.

A row is a JSON array of non-empty strings: a broker name, then the target topics it served (none is
allowed). Rows are written in order of broker, each one's topics in order, every broker once. Two
forms hold them (docs/FORMAT.md, "Served brokers"):

- lines, the data directory's `dedupe-brokers.txt`: `FILE_HEADER`, then one row a line, written as
  `json.dumps` writes it (`["broker-a", "T", "U"]`); read back, blank lines and lines whose first
  other character is `#` are passed over. Rows learnt later are appended (`encode_lines` without the
  header), so a broker may have several lines: `topics_of` merges them. A crash in an append can leave
  a last line without its line break that is not a row: `cut_torn` sets it apart.
- an array, a part of a replica set's `dedupe-brokers` znode: every row in one compact JSON array
  (`[["broker-a","T","U"],["broker-b","T"]]`); no bytes at all read as no rows.

Both escape every character outside ASCII (`\\u00fc`), so no row's line holds a line break. A
decoder refuses anything else with `BrokerRowsError`, naming the line or row and what is wrong in it.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence

from storage.errors import StorageError

__all__ = ["FILE_HEADER", "BrokerRowsError", "cut_torn", "decode_array", "decode_lines", "encode_array",
           "encode_lines", "pairs_of", "rows_of", "rows_of_pairs", "topics_of"]

#: the first line of the file form
FILE_HEADER = ("# brokers that served the engine's target topics, one JSON array a line: [broker, topic, ...]; "
               "delete a broker's lines once it is gone for good (docs/OPERATIONS.md)\n")
_EXCERPT = 200  # characters of the offending text quoted in an error


class BrokerRowsError(StorageError, ValueError):
    """Text or bytes that do not hold `[broker, topic, ...]` rows: `where` (a line, a row) and `reason` say what."""

    def __init__(self, where: str, reason: str, excerpt: str | bytes) -> None:
        super().__init__(f"{where}: {reason}: {excerpt[:_EXCERPT]!r}")
        self.where = where
        self.reason = reason


def rows_of(topics: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Topic -> its brokers as rows, in order (a topic without brokers has none)."""
    return rows_of_pairs((b, t) for t, brokers in topics.items() for b in brokers)


def rows_of_pairs(pairs: Iterable[tuple[str, str]]) -> list[list[str]]:
    """(broker, topic) pairs as rows, in order."""
    by_broker: dict[str, list[str]] = {}
    for broker, topic in sorted(set(pairs)):
        by_broker.setdefault(broker, []).append(topic)
    return [[b, *ts] for b, ts in by_broker.items()]


def pairs_of(rows: Iterable[Sequence[str]]) -> set[tuple[str, str]]:
    """Every (broker, topic) pair the rows hold."""
    return {(r[0], t) for r in rows for t in r[1:]}


def topics_of(rows: Iterable[Sequence[str]]) -> dict[str, set[str]]:
    """Topic -> the brokers the rows name for it."""
    topics: dict[str, set[str]] = {}
    for row in rows:
        for topic in row[1:]:
            topics.setdefault(topic, set()).add(row[0])
    return topics


def encode_lines(rows: Iterable[Sequence[str]], header: bool = True) -> str:
    """The file form: `FILE_HEADER` (unless `header` is false: lines to append), then one row a line."""
    return (FILE_HEADER if header else "") + "".join(json.dumps(list(r)) + "\n" for r in rows)


def cut_torn(data: bytes) -> tuple[bytes, bytes]:
    """The file form's bytes split before a torn last line: one without its line break that is neither a
    row, a comment nor blank (what a crash in an append leaves); `(data, b"")` when there is none."""
    start = data.rfind(b"\n") + 1
    last = data[start:]
    if not last:
        return data, b""
    try:
        decode_lines(last.decode())
    except (UnicodeDecodeError, BrokerRowsError):  # cut inside a character, or inside the JSON
        return data[:start], last
    return data, b""


def decode_lines(text: str) -> list[list[str]]:
    """The rows of the file form; `BrokerRowsError` naming the first line that is not a row."""
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        rows.append(_checked(_loads(line, f"line {n}"), f"line {n}", line))
    return rows


def encode_array(rows: Iterable[Sequence[str]]) -> bytes:
    """The array form: every row in one compact JSON array."""
    return json.dumps([list(r) for r in rows], separators=(",", ":")).encode()


def decode_array(data: bytes) -> list[list[str]]:
    """The rows of the array form (no bytes: none); `BrokerRowsError` naming what is wrong."""
    if not data:
        return []
    rows = _loads(data, "the array")
    if not isinstance(rows, list):
        raise BrokerRowsError("the array", f"{_kind(rows)}, not an array of rows", data)
    return [_checked(row, f"row {k}", data) for k, row in enumerate(rows, 1)]


def _loads(text: str | bytes, where: str) -> object:
    """JSON, or `BrokerRowsError` saying why not."""
    try:
        return json.loads(text)
    except ValueError as e:  # a JSON error, or bytes that are not UTF-8
        raise BrokerRowsError(where, f"not JSON ({e})", text) from e
    except RecursionError as e:  # nested past what the parser follows
        raise BrokerRowsError(where, "nested too deeply", text) from e


def _checked(row: object, where: str, excerpt: str | bytes) -> list[str]:
    """`row` if it is [broker, topic, ...] of non-empty strings; else `BrokerRowsError` quoting `excerpt`."""
    if not isinstance(row, list):
        raise BrokerRowsError(where, f"{_kind(row)}, not an array [broker, topic, ...]", excerpt)
    if not row:
        raise BrokerRowsError(where, "an empty array, no broker name", excerpt)
    for i, item in enumerate(row):
        if not isinstance(item, str) or not item:
            what = "the broker name" if i == 0 else f"topic {i}"
            fault = "empty" if item == "" else f"{_kind(item)}, not a string"
            raise BrokerRowsError(where, f"{what} is {fault}", excerpt)
    return row


def _kind(value: object) -> str:
    """What a decoded JSON value is, in JSON's words."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, dict):
        return "an object"
    return "an array" if isinstance(value, list) else "a string"
