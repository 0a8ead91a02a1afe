"""The meta store's ids and business keys, whatever text they hold: what a commit writes is what a
look-up finds (the location keys of a commit are built in one join and split, with a plain way for
ids the split would cut)."""
from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from storage import MetaStore
from storage.meta import Location

HOUR = 3_600_000
BASE = 1_800_000_000_000 - 1_800_000_000_000 % HOUR

_TEXT = st.text(st.characters(codec="utf-8"), min_size=1, max_size=12)  # NUL included


@settings(max_examples=60, deadline=None)
@given(rows=st.dictionaries(_TEXT, st.tuples(st.integers(0, 5), st.integers(0, 2**32 - 1),
                                              st.lists(_TEXT.filter(lambda k: "\x00" not in k), max_size=2)),
                            max_size=20),
       unknown=st.lists(_TEXT, max_size=4))
def test_every_id_written_is_found_where_it_was_written_and_no_other(
        rows: dict[str, tuple[int, int, list[str]]], unknown: list[str]) -> None:
    ids = list(rows)
    with tempfile.TemporaryDirectory() as tmp:
        meta = MetaStore(Path(tmp) / "meta")
        try:
            meta.put_records(ids, [BASE + HOUR * p for p, _, _ in rows.values()], [p for p, _, _ in rows.values()],
                             [o for _, o, _ in rows.values()], [tuple(ks) for _, _, ks in rows.values()])
            missing = [u for u in unknown if u not in rows]
            found = meta.locations(ids + missing)
            assert found == [Location(BASE + HOUR * p, p, o) for p, o, _ in rows.values()] + [None] * len(missing)
            assert meta.known(ids + missing) == [True] * len(ids) + [False] * len(missing)
            for key in {k for _, _, ks in rows.values() for k in ks}:
                assert sorted(meta.ids_for_key(key)) == sorted(m for m, (_, _, ks) in rows.items() if key in ks)
        finally:
            meta.close()


def test_an_id_holding_nul_keeps_its_own_key() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        meta = MetaStore(Path(tmp) / "meta")
        try:
            meta.put_records(["a\x00b", "a"], [BASE, BASE], [0, 1], [10, 20], [(), ()])
            assert meta.locations(["a", "b", "a\x00b"]) == [Location(BASE, 1, 20), None, Location(BASE, 0, 10)]
        finally:
            meta.close()
