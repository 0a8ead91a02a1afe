"""The garbage collector's pauses, timed by generation and exported; the started heap frozen."""
from __future__ import annotations

import gc
from typing import Iterator

import pytest

from timewheel.app.gc_pauses import GcPauses, freeze_started_heap
from timewheel.app.metrics import GcPausesCollector


@pytest.fixture
def pauses() -> Iterator[GcPauses]:
    p = GcPauses().install()
    yield p
    p.remove()


def test_each_collection_is_timed_under_its_generation(pauses: GcPauses) -> None:
    before = pauses.snapshot()
    gc.collect(2)
    gc.collect(0)
    after = pauses.snapshot()
    assert after[2].collections >= before[2].collections + 1
    assert after[0].collections >= before[0].collections + 1
    assert after[2].seconds > before[2].seconds
    assert after[2].longest_seconds > 0
    assert after[2].longest_seconds <= after[2].seconds


def test_a_reset_forgets_and_a_removed_watch_times_nothing_more() -> None:
    p = GcPauses().install()
    p.install()  # twice: still one callback
    assert gc.callbacks.count(p._on_collection) == 1
    gc.collect(2)
    assert p.snapshot()[2].collections >= 1
    p.reset()
    assert [g.collections for g in p.snapshot()] == [0, 0, 0]
    assert [g.longest_seconds for g in p.snapshot()] == [0.0, 0.0, 0.0]
    p.remove()
    p.remove()
    gc.collect(2)
    assert [g.collections for g in p.snapshot()] == [0, 0, 0]


def test_the_pauses_and_the_frozen_heap_are_exported(pauses: GcPauses, monkeypatch: pytest.MonkeyPatch) -> None:
    gc.collect(1)
    try:
        frozen = pauses.frozen = freeze_started_heap()
        assert frozen > 1000

        # counting the frozen list walks all of it under the interpreter's lock (every engine thread
        # stopped for milliseconds): a scrape reports the count the freeze took instead
        def walk() -> int:
            raise AssertionError("a scrape walked the frozen heap")

        monkeypatch.setattr(gc, "get_freeze_count", walk)
        samples = {(s.name, s.labels.get("generation")): s.value
                   for m in GcPausesCollector(pauses).collect() for s in m.samples}
    finally:
        gc.unfreeze()
    snap = pauses.snapshot()
    assert samples[("timewheel_gc_pauses_total", "1")] == snap[1].collections >= 1
    assert samples[("timewheel_gc_pause_seconds_total", "2")] == pytest.approx(snap[2].seconds)
    assert samples[("timewheel_gc_pause_longest_seconds", "2")] == snap[2].longest_seconds > 0
    assert samples[("timewheel_gc_frozen_objects", None)] == frozen


def test_a_full_collection_walks_only_what_was_made_since_the_freeze() -> None:
    keep = [[i] for i in range(10_000)]  # a started heap's tracked objects
    try:
        freeze_started_heap()
        made_since = [[i] for i in range(3)]
        walked = gc.get_objects()  # what a full collection walks: every generation but the frozen
        assert not any(o is keep for o in walked)
        assert any(o is made_since for o in walked)
        assert len(walked) < 1000
    finally:
        gc.unfreeze()
    assert any(o is keep for o in gc.get_objects()), "unfrozen, they are the collector's again"


def test_reading_the_pauses_while_collections_run_does_not_deadlock(pauses: GcPauses) -> None:
    """A collection may start inside `snapshot` (it allocates): the callback takes no lock it could hold."""
    import threading

    def read() -> None:
        old = gc.get_threshold()
        gc.set_threshold(1)  # a collection at nearly every allocation
        try:
            for _ in range(200):
                pauses.snapshot()
                pauses.reset()
        finally:
            gc.set_threshold(*old)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(30)
    assert not reader.is_alive(), "reading the pauses deadlocked inside a collection"
