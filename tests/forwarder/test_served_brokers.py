"""The data directory's memory of the brokers that served each target topic, as a replica set shares it:
many topics noted at once, watchers told of what is new, a snapshot that reads the file again."""
from __future__ import annotations

from pathlib import Path

import pytest

import forwarder._served_brokers as served_brokers
from forwarder._served_brokers import ServedBrokers


def test_many_topics_noted_at_once_write_the_file_once_and_tell_the_watchers_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writes: list[dict[str, set[str]]] = []
    real_write = served_brokers._write

    def write(path: Path, topics: dict[str, set[str]]) -> None:
        writes.append(topics)
        real_write(path, topics)

    monkeypatch.setattr(served_brokers, "_write", write)
    served = ServedBrokers(tmp_path / "dedupe-brokers.txt")
    told: list[list[str]] = []
    served.watch(lambda: told.append(served.problems("T", [])))  # what a look-up of T would wait for, then
    served.note_all({"T": ["broker-a", "broker-b"], "U": ["broker-b"], "V": []})
    assert len(writes) == 1 and len(told) == 1
    assert len(told[0]) == 2 and "broker broker-b served T" in told[0][1], "the watcher finds what was noted"
    served.note_all({"T": ["broker-a"], "U": ["broker-b"]})  # nothing new: no write, nobody told
    assert len(writes) == 1 and len(told) == 1
    assert ServedBrokers(tmp_path / "dedupe-brokers.txt").snapshot() == {"T": {"broker-a", "broker-b"},
                                                                         "U": {"broker-b"}}


def test_a_snapshot_reads_what_an_operator_left_in_the_file(tmp_path: Path) -> None:
    memory = tmp_path / "dedupe-brokers.txt"
    served = ServedBrokers(memory)
    served.note("T", ["broker-a", "broker-b"])
    memory.write_text("\n".join(line for line in memory.read_text().splitlines()
                                if not line.startswith('["broker-b"')) + "\n")  # gone for good
    assert served.snapshot() == {"T": {"broker-a"}}, "published as the file has it, not as memory had it"


def test_the_file_holds_the_bytes_it_always_held(tmp_path: Path) -> None:
    memory = tmp_path / "dedupe-brokers.txt"
    served = ServedBrokers(memory)
    served.note_all({"T": ["broker-b", "broker-a"], "U": ["broker-a"], "T\u00f6": ["broker-\u00fc"]})
    assert memory.read_bytes() == (
        b"# brokers that served the engine's target topics, one JSON array a line: [broker, topic, ...]; "
        b"delete a broker's line once it is gone for good (docs/OPERATIONS.md)\n"
        b'["broker-a", "T", "U"]\n["broker-b", "T"]\n["broker-\\u00fc", "T\\u00f6"]\n')
    assert ServedBrokers(memory).snapshot() == {"T": {"broker-a", "broker-b"}, "U": {"broker-a"},
                                                "T\u00f6": {"broker-\u00fc"}}


def test_a_line_that_is_not_a_row_leaves_the_file_unreadable_naming_the_line(tmp_path: Path) -> None:
    memory = tmp_path / "dedupe-brokers.txt"
    memory.write_text('# brokers\n["broker-a", "T"]\n["", "T"]\n')
    served = ServedBrokers(memory)
    assert served.unreadable is not None and "line 3: the broker name is empty" in served.unreadable
    assert served.problems("T", ["broker-a"]) == [served.unreadable]
