"""The data directory's memory of the brokers that served each target topic, as a replica set shares it:
many topics noted at once, watchers told of what is new, a snapshot that reads the file again; new pairs
appended rather than the file rewritten, and a last line a crash tore inside an append cut."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import forwarder._served_brokers as served_brokers
from forwarder._served_brokers import ServedBrokers
from storage import broker_topics_of, decode_broker_lines


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
        b"delete a broker's lines once it is gone for good (docs/OPERATIONS.md)\n"
        b'["broker-a", "T", "U"]\n["broker-b", "T"]\n["broker-\\u00fc", "T\\u00f6"]\n')
    assert ServedBrokers(memory).snapshot() == {"T": {"broker-a", "broker-b"}, "U": {"broker-a"},
                                                "T\u00f6": {"broker-\u00fc"}}


def test_a_line_that_is_not_a_row_leaves_the_file_unreadable_naming_the_line(tmp_path: Path) -> None:
    memory = tmp_path / "dedupe-brokers.txt"
    memory.write_text('# brokers\n["broker-a", "T"]\n["", "T"]\n')
    served = ServedBrokers(memory)
    assert served.unreadable is not None and "line 3: the broker name is empty" in served.unreadable
    assert served.problems("T", ["broker-a"]) == [served.unreadable]


# ---- appended, not rewritten: a producer naming a new target topic per message ----------------------------------

def _rows_in(memory: Path) -> dict[str, set[str]]:
    return broker_topics_of(decode_broker_lines(memory.read_text()))


def test_new_target_topics_are_appended_and_the_file_is_rewritten_whole_only_as_it_doubles(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    memory = tmp_path / "dedupe-brokers.txt"
    rewrites: list[int] = []  # the file's bytes after each whole rewrite (temporary file renamed over it)
    reads: list[str] = []
    real_replace, real_decode = os.replace, served_brokers.decode_broker_lines

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        real_replace(src, dst)
        if Path(dst) == memory:
            rewrites.append(memory.stat().st_size)

    def decode(text: str) -> list[list[str]]:
        reads.append(text)
        return real_decode(text)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(served_brokers, "decode_broker_lines", decode)
    served = ServedBrokers(memory)
    topics = 3000
    for n in range(topics):
        served.note(f"topic-{n:06d}", ["broker-a", "broker-b"])
        assert len(rewrites) <= 12, f"{len(rewrites)} whole rewrites for {n + 1} new topics"
    assert len(reads) <= 1, f"the file was read {len(reads)} times for {topics} new topics"
    assert served.write_error is None
    size = memory.stat().st_size
    assert sum(rewrites) <= 3 * size, "the bytes rewritten grow with the file, not with the topics times the file"
    assert _rows_in(memory) == {f"topic-{n:06d}": {"broker-a", "broker-b"} for n in range(topics)}


def test_a_torn_last_line_is_cut_when_the_file_is_read_and_the_rows_before_it_kept(tmp_path: Path) -> None:
    memory = tmp_path / "dedupe-brokers.txt"
    ServedBrokers(memory).note("T", ["broker-a"])
    ServedBrokers(memory).note("U", ["broker-a", "broker-b"])  # appended
    kept = memory.read_bytes()
    with open(memory, "ab") as f:
        f.write(b'["broker-c", "V", "W')  # the engine crashed inside an append: that note never returned
    served = ServedBrokers(memory)
    assert served.unreadable is None
    assert served.snapshot() == {"T": {"broker-a"}, "U": {"broker-a", "broker-b"}}
    assert memory.read_bytes() == kept, "the torn line is cut"
    served.note("V", ["broker-c"])
    assert memory.read_bytes() == kept + b'["broker-c", "V"]\n'
    assert ServedBrokers(memory).snapshot() == {"T": {"broker-a"}, "U": {"broker-a", "broker-b"},
                                                "V": {"broker-c"}}


def test_a_whole_last_row_without_its_line_break_is_kept(tmp_path: Path) -> None:
    memory = tmp_path / "dedupe-brokers.txt"
    memory.write_text('# by hand\n["broker-a", "T"]\n["broker-b", "T"]')
    served = ServedBrokers(memory)
    assert served.snapshot() == {"T": {"broker-a", "broker-b"}}
    served.note("U", ["broker-b"])
    assert memory.read_text() == '# by hand\n["broker-a", "T"]\n["broker-b", "T"]\n["broker-b", "U"]\n'


def test_a_bad_line_before_the_last_still_leaves_the_file_unreadable_and_untouched(tmp_path: Path) -> None:
    memory = tmp_path / "dedupe-brokers.txt"
    text = '# brokers\n["broker-a", "T"]\n["broker-b", "T\n["broker-c", "U"]\n["broker-d", "V'
    memory.write_text(text)
    served = ServedBrokers(memory)
    assert served.unreadable is not None and "line 3: not JSON" in served.unreadable
    served.note("W", ["broker-e"])
    assert served.problems("W", ["broker-e"]) == [served.unreadable]
    assert memory.read_text() == text, "left for the operator to mend: nothing cut, nothing appended"
    memory.unlink()  # mended by deleting it
    assert served.problems("W", ["broker-e"]) == []
    assert _rows_in(memory) == {"W": {"broker-e"}}, "what was learnt meanwhile is written"


def test_what_was_noted_one_topic_at_a_time_reads_back_after_a_restart(tmp_path: Path) -> None:
    memory = tmp_path / "dedupe-brokers.txt"
    noted: dict[str, set[str]] = {}
    served = ServedBrokers(memory)
    for n in range(40):
        brokers = {f"broker-{c}" for c in "abc"[: 1 + n % 3]}
        served.note(f"T{n % 25}\u00f6", brokers)
        noted.setdefault(f"T{n % 25}\u00f6", set()).update(brokers)
        if n % 10 == 9:
            served = ServedBrokers(memory)  # started again
    assert len(memory.read_text().splitlines()) > 4, "a broker's rows appended on several lines"
    assert ServedBrokers(memory).snapshot() == noted == served.snapshot()
    assert _rows_in(memory) == noted


notes = st.dictionaries(st.sampled_from(["T", "U", "V\u00fc", "W", "X"]),
                        st.sets(st.sampled_from(["broker-a", "broker-b", "c"]), max_size=3), min_size=1, max_size=3)
steps = st.lists(st.one_of(notes.map(lambda n: ("note", n)), st.just(("reopen", {})),
                           st.just(("crash", {})), st.just(("compact", {}))), max_size=12)


@settings(max_examples=150, deadline=None)
@given(steps, st.sampled_from([0, 40, 10**9]))
def test_any_notes_reopens_crashes_and_compactions_read_back_the_union(
        plan: list[tuple[str, dict[str, set[str]]]], slack: int) -> None:
    with tempfile.TemporaryDirectory() as d, mock.patch.object(served_brokers, "_SLACK", slack):
        memory = Path(d) / "dedupe-brokers.txt"
        served, noted = ServedBrokers(memory), dict[str, set[str]]()
        for step, noting in plan:
            if step == "note":
                served.note_all(noting)
                for t, bs in noting.items():
                    if bs:
                        noted.setdefault(t, set()).update(bs)
            elif step == "crash" and memory.exists():  # inside an append whose note never returned
                with open(memory, "ab") as f:
                    f.write(b'["broker-z", "T", "Q"]\n'[: len(memory.read_bytes()) % 21 + 1])
                served = ServedBrokers(memory)
            elif step == "compact":  # a new topic noted while the file is past its bound
                with mock.patch.object(served_brokers, "_SLACK", -(10**9)):
                    served.note(f"C{len(noted)}", ["broker-a"])
                noted.setdefault(f"C{len(noted)}", set()).add("broker-a")
            else:
                served = ServedBrokers(memory)
            assert served.unreadable is None and served.write_error is None
            assert served.snapshot() == noted
        assert ServedBrokers(memory).snapshot() == noted
        assert noted == {} or _rows_in(memory) == noted
