"""A power loss (not a process kill) under flush="sync": a store reopened on what the disk kept
holds every record, dispatch outcome and tombstone it acknowledged, and serves nothing corrupt.

The disk is modelled (`tests/storage/_power_loss.py`): what a power loss keeps of each file is its
content at its last fsync, of each directory its entries at its last fsync. A seeded workload
(`tests/storage/_power_workload.py`) runs under the model; at random sync points the disk a power
loss would leave is written out, a store opened on it, and checked against what the workload had
been told was stored. A power loss during the recovery that follows is checked the same way.
`TW_POWER_LOSS_SEEDS=N` runs N seeds instead of the few CI runs (`TW_POWER_LOSS_STEPS`, operations a
seed, and `TW_POWER_LOSS_CUT_SHARE`, the share of sync points where the power goes, go further).
"""
from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from storage import CANCELLED, PartStager, Record, dispatch_entries
from storage.ingest_log import IngestLog
from tests.storage._power_loss import DiskModel, Flavour, Image, Watch, materialize
from tests.storage._power_workload import (SEGMENT_MS, START, Ledger, Mark, Workload, kill, open_store,
                                           verify)

#: seeds run in CI, and operations per seed
SEEDS = int(os.environ.get("TW_POWER_LOSS_SEEDS", "3"))
STEPS = int(os.environ.get("TW_POWER_LOSS_STEPS", "120"))
#: the share of sync points at which the power goes
CUT_SHARE = float(os.environ.get("TW_POWER_LOSS_CUT_SHARE", "0.12"))
#: and near a restart after a kill (`Workload.near_restart`)
NEAR_RESTART_SHARE = 0.4
#: what else than the durable state a cut's disk holds: strictly nothing, half the time
FLAVOURS = [Flavour.STRICT, Flavour.STRICT, Flavour.ORDERED, Flavour.WRITEBACK]
#: the share of cuts after which the power goes again during the recovery that follows
NESTED_SHARE = 0.1
#: and the sync points of that recovery at which it goes
NESTED_CUTS = 4


def _run(seed: int, tmp: Path, watch: Watch, *, steps: int = STEPS) -> list[str]:
    """One seeded workload under the model, its cuts checked; what went wrong, one line a cut."""
    rng = random.Random(seed)
    model = DiskModel(tmp / "data", tmp / "work")
    (tmp / "work").mkdir()
    workload = Workload(model, random.Random(seed * 7919 + 1))
    images: list[Image] = []

    def on_cut(label: str) -> None:
        if rng.random() < (NEAR_RESTART_SHARE if workload.near_restart() else CUT_SHARE):
            images.append(model.image(label, workload.ledger.mark()))

    model.on_cut = on_cut
    with watch.watching(model):
        workload.run(steps)
    images.append(model.image("after close", workload.ledger.mark()))
    failures: list[str] = []
    for k, image in enumerate(images):
        flavour = rng.choice(FLAVOURS)
        dest = tmp / f"cut{k}-{flavour.value}"
        meta = rng.choice(["now", "synced"])
        materialize(image, dest, flavour, random.Random(seed * 1_000 + k), meta=meta)
        nested = rng.random() < NESTED_SHARE
        problems = (_recovery_cut_short(dest, tmp / "work", workload.ledger, image.mark, watch, rng)
                    if nested else verify(dest, workload.ledger, image.mark))
        if problems:
            failures.append(f"seed {seed}, cut {k} at {image.label!r} ({flavour.value}, meta store as {meta}"
                            f"{', power lost again in recovery' if nested else ''}): {problems[:3]}")
        shutil.rmtree(dest)
    shutil.rmtree(tmp / "work")  # the meta store's copies: a run leaves thousands
    return failures


def _recovery_cut_short(dest: Path, work: Path, ledger: Ledger, mark: Mark, watch: Watch,
                        rng: random.Random) -> list[str]:
    """Open (recover) and close a store on `dest` under a model of its own, the power going again
    at some of its sync points; each of those disks checked."""
    model = DiskModel(dest, work)
    model.everything_durable()
    images: list[Image] = []
    model.on_cut = lambda label: images.append(model.image(label, mark, lenient=False))
    with watch.watching(model):
        try:
            open_store(dest).close()
        except Exception as e:  # the store that cannot open is the finding
            return [f"the store does not open: {type(e).__name__}: {e}"]
    problems: list[str] = []
    for k, image in enumerate(rng.sample(images, min(NESTED_CUTS, len(images)))):
        again = dest.with_name(f"{dest.name}-again{k}")
        materialize(image, again)
        problems += [f"recovery cut at {image.label!r}: {p}" for p in verify(again, ledger, mark)]
        shutil.rmtree(again)
    return problems or verify(dest, ledger, mark)


@pytest.mark.parametrize("seed", range(SEEDS))
def test_power_loss_under_sync_loses_nothing_acknowledged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          seed: int) -> None:
    failures = _run(seed, tmp_path, Watch(monkeypatch))
    assert not failures, "\n".join(failures[:10])


def _power_loss_now(model: DiskModel, dest: Path) -> Path:
    """The disk a power loss right now would leave of `model`'s directory, written to `dest`."""
    materialize(model.image("now", None, lenient=False), dest)
    return dest


def test_a_new_data_directory_opens_after_a_power_loss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """timewheel.json was renamed into place, and its directory fsynced, but its own bytes never
    were: the name survived a power loss, empty, and the store refused to open."""
    watch = Watch(monkeypatch)
    model = DiskModel(tmp_path / "data", tmp_path / "work")
    (tmp_path / "work").mkdir()
    with watch.watching(model):
        open_store(model.root).close()
    open_store(_power_loss_now(model, tmp_path / "after")).close()


SEG = START + 10 * SEGMENT_MS


def test_a_synced_outcome_in_a_new_segment_survives_a_power_loss(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A segment's directory made since the last checkpoint, then its first outcome recorded: the
    new dispatch log's directory was fsynced, not `schedule/`, whose entry for that directory a power
    loss then took, and the outcome with it (the records came back from the ingest log)."""
    watch = Watch(monkeypatch)
    model = DiskModel(tmp_path / "data", tmp_path / "work")
    (tmp_path / "work").mkdir()
    with watch.watching(model):
        store = open_store(model.root)
        store.append([Record("m", "T", b"x", SEG + 1)], START)
        ix = store.segment_index(SEG)
        store.record_dispatch(SEG, dispatch_entries(ix.part, ix.offset, ix.due_ms, START, CANCELLED), START)
        after = _power_loss_now(model, tmp_path / "after")
        store.close()
    with open_store(after) as store:
        assert store.dispatch_log(SEG).entries["outcome"].tolist() == [CANCELLED]


def test_records_replayed_after_a_kill_survive_a_power_loss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Killed before the checkpoint that would have made a new segment directory's name durable,
    the store started again: its recovery replayed the records into the directory the page cache
    still held, and its checkpoint fsynced that directory, not `schedule/`, then let the ingest log
    go. A power loss then took the segment directory, and the records with it."""
    watch = Watch(monkeypatch)
    model = DiskModel(tmp_path / "data", tmp_path / "work")
    (tmp_path / "work").mkdir()
    with watch.watching(model):
        store = open_store(model.root)
        store.append([Record("m", "T", b"x", SEG + 1)], START)
        kill(store, model)
        store = open_store(model.root)
        after = _power_loss_now(model, tmp_path / "after")
        store.close()
    with open_store(after) as store:
        loc = store.meta.locations(["m"])[0]
        assert loc is not None
        assert store.read_record(loc.segment_ms, loc.part, loc.offset).msg_id == "m"


def test_a_part_published_into_a_new_segment_survives_a_power_loss(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A backfill published a part into a segment directory the store had made since its last
    checkpoint: the publish fsynced the segment directory, not `schedule/` (it had not made the
    directory), removed its staged copy, and a power loss took the directory and the part."""
    watch = Watch(monkeypatch)
    model = DiskModel(tmp_path / "data", tmp_path / "work")
    (tmp_path / "work").mkdir()
    with watch.watching(model):
        store = open_store(model.root)
        store.append([Record("m", "T", b"x", SEG + 1)], START)
        staging = model.root / "_staging"
        staging.mkdir()
        stager = PartStager(staging, "job", SEGMENT_MS, START)
        stager.add(Record("backfilled", "T", b"y", SEG + 2))
        for part in stager.finish():
            store.layout.publish_part(part.segment_ms, part.log, part.index)
        after = _power_loss_now(model, tmp_path / "after")
        store.close()
    with open_store(after) as store:
        ix = store.segment_index(SEG)
        ids = [r.msg_id for r in store.read_records([SEG] * len(ix), ix.part.tolist(), ix.offset.tolist())
               if isinstance(r, Record)]
        assert sorted(ids) == ["backfilled", "m"]


def test_the_model_finds_an_ingest_log_frame_acknowledged_unsynced(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: with the frame's fdatasync left out, acknowledged records are lost."""
    real_append = IngestLog.append

    def unsynced(log: IngestLog, locations: np.ndarray, records: list[bytes], written_ms: int, sync: bool) -> None:
        real_append(log, locations, records, written_ms, False)

    monkeypatch.setattr(IngestLog, "append", unsynced)
    failures = _run(0, tmp_path, Watch(monkeypatch), steps=40)
    assert any("is not in the meta store" in f for f in failures), failures[:3]
