"""A store that no retry can heal (a corrupt meta store, a closed store) stops ingest at once: the
batch is not acknowledged, the service goes not ready naming the store's own error, and the log says
it once, instead of "it will be pulled again" at every retry until `consume_refused_max_s` ends it."""
from __future__ import annotations

import contextlib
import logging
import os
import uuid
from pathlib import Path
from typing import Any, Sequence

import pytest

from forwarder.config import RocketMQConfig
from forwarder.contract import ContractLimits
from forwarder.control import CANCEL_ID
from forwarder.ingest import DelayTopicIngest
from forwarder.local_rocketmq import LocalRocketMQ
from forwarder.rocketmq import BatchesRefusedError, OutgoingMessage, ReceivedMessage, Receipt, RemotingProducer
from storage import MetaStoreCorruptError, MetaStoreStoppedError, StorageWriteError, StoreClosedError
from timewheel.app.service import Service
from timewheel.app.settings import Settings
from timewheel.cancels import CancelRequest
from timewheel.config import EngineConfig
from tests.polling import wait_for
from tests.reliability.test_pull_thread_death import _restart_delivers_the_one_message

CORRUPT = MetaStoreCorruptError("/data/meta", "/data/meta/000042.sst", "Corruption: block checksum mismatch")


def _ingested(service: Service) -> int:
    ingest = service.stats()["ingest"]
    assert isinstance(ingest, dict)
    return int(ingest["ingested"])


def _telling(caplog: pytest.LogCaptureFixture, words: str) -> list[logging.LogRecord]:
    """The log records whose line or traceback holds `words`."""
    return [r for r in caplog.records if words in r.getMessage() or words in (r.exc_text or "")]


def _topics(rocketmq: LocalRocketMQ, tag: str) -> tuple[str, RocketMQConfig, str]:
    """A run id, an ingest config on topics and groups of its own, and its target topic (all created)."""
    run = uuid.uuid4().hex[:8]
    cfg = RocketMQConfig(namesrv=rocketmq.namesrv_addr, delay_topic=f"TW_DELAY_{tag.upper()}{run}",
                         dead_letter_topic=f"TW_DLQ_{tag.upper()}{run}", consumer_group=f"tw_ingest_{tag}{run}",
                         producer_group=f"tw_delivery_{tag}{run}", send_timeout_ms=2000)
    target = f"TARGET_{tag.upper()}{run}"
    rocketmq.create_topics([cfg.delay_topic, cfg.dead_letter_topic, target], queues=2)
    return run, cfg, target


@pytest.mark.rocketmq
@pytest.mark.slow
def test_a_corrupt_meta_store_stops_ingest_at_once_unacknowledged_and_says_so_once(
        rocketmq: LocalRocketMQ, tmp_path_factory: pytest.TempPathFactory, caplog: pytest.LogCaptureFixture) -> None:
    run, cfg, target = _topics(rocketmq, "c")
    settings = Settings(engine=EngineConfig(tmp_path_factory.mktemp("corruptmeta")), rocketmq=cfg)
    service = Service(settings).start()
    try:
        assert wait_for(service.ready, timeout=30)
        engine = service.engine
        assert engine is not None and engine.store is not None
        store = engine.store
        tries: list[str] = []

        def corrupt_once(real: Any) -> Any:
            def append(*args: Any, **kwargs: Any) -> Any:
                tries.append(real.__name__)
                if len(tries) == 1:  # a retry would succeed here: only a stop at once keeps it unstored
                    raise CORRUPT
                return real(*args, **kwargs)
            return append

        store.append = corrupt_once(store.append)  # type: ignore[method-assign]
        store.append_encoded = corrupt_once(store.append_encoded)  # type: ignore[method-assign]
        caplog.set_level(logging.INFO)
        with RemotingProducer(rocketmq.namesrv_addr, f"corrupt_producer_{run}") as p:
            [receipt] = p.send([OutgoingMessage(cfg.delay_topic, b"held", None, None,
                                                {"TW_TARGET_TOPIC": target, "TW_DELAY_MS": "100"})])
        assert isinstance(receipt, Receipt)
        assert wait_for(lambda: not service.ready() or _ingested(service) > 0, timeout=30), service.stats()["ingest"]
        assert not service.ready(), f"stored on a retry after {tries}: the corrupt store was taken for a passing fault"
        assert _ingested(service) == 0 and tries == ["append_encoded"]
        assert service.dead_threads() == ["ingest-pull-broker-a"]
        [why] = [w for w in service.not_ready_why() if "ingest-pull-broker-a" in w]
        assert "MetaStoreCorruptError: the meta store /data/meta is corrupt: RocksDB found damage in " \
               "/data/meta/000042.sst" in why, why
        [told] = _telling(caplog, "the meta store /data/meta is corrupt")  # once, not once per retry
        assert "move /data/meta aside" in (told.exc_text or ""), told.exc_text
        assert not _telling(caplog, "pulled again")
        assert service.stats()["ingest"]["redelivered"] == 0  # type: ignore[index]
    finally:
        service.stop()
    _restart_delivers_the_one_message(settings)  # not acknowledged: the next start stores and delivers it


def _ingest(cancel: Any) -> DelayTopicIngest:
    """An ingest taking control-only batches, as a pull thread hands them over."""
    ing = DelayTopicIngest(RocketMQConfig(namesrv="127.0.0.1:1"), ContractLimits(10**9, 1 << 20), lambda: 1000,
                           None)  # type: ignore[arg-type]  # no dead letter in these batches
    ing._schedule, ing._cancel = lambda messages, origins: [], cancel
    ing._accepting.set()
    return ing


def _cancel_message(n: int) -> ReceivedMessage:
    return ReceivedMessage("TW_DELAY", b"", "", "", f"C{n:031X}", {CANCEL_ID: f"{n:032X}"}, 0, 0, 0, n, 990, 1000)


@pytest.mark.parametrize("error", [CORRUPT, StoreClosedError("the store is closed"),
                                   MetaStoreStoppedError("/data/meta", "IO error: No space left on device")])
def test_cancels_a_broken_store_can_never_apply_stop_the_pull_and_every_later_batch(
        error: Exception, caplog: pytest.LogCaptureFixture) -> None:
    calls: list[int] = []

    def cancel(requests: list[CancelRequest]) -> int:
        calls.append(len(requests))
        raise error

    ing = _ingest(cancel)
    with pytest.raises(BatchesRefusedError, match=f"applying 1 cancels failed for good.*{type(error).__name__}: "):
        ing._on_batch([_cancel_message(1)])
    # another broker's batch: refused the same way, without trying the broken store again
    with pytest.raises(BatchesRefusedError, match=type(error).__name__):
        ing._on_batch([_cancel_message(2)])
    assert calls == [1] and ing.counters["cancels_received"] == 0
    assert not _telling(caplog, "pulled again")


def test_a_full_disk_is_still_a_passing_fault_whose_batch_is_pulled_again(caplog: pytest.LogCaptureFixture) -> None:
    outcomes = [StorageWriteError("could not record 1 dispatch entries: No space left on device"), None]

    def cancel(requests: list[CancelRequest]) -> int:
        e = outcomes.pop(0)
        if e is not None:
            raise e
        return 0

    ing = _ingest(cancel)
    assert ing._on_batch([_cancel_message(1)]) is False
    assert len(_telling(caplog, "the batch will be pulled again")) == 1
    assert ing._on_batch([_cancel_message(1)]) is True and ing.counters["cancels_received"] == 1


def test_a_lasting_full_disk_logs_its_traceback_once_a_minute_not_at_every_retry(
        caplog: pytest.LogCaptureFixture) -> None:
    """Every pull thread's batch is pulled again about once a second while the disk stays full, until
    `consume_refused_max_s`: the run's first failure is logged with its traceback, then its count a minute
    later, and its end once."""
    t = [100.0]
    full = StorageWriteError("could not record 1 dispatch entries: No space left on device")
    disk_full = [True]

    def cancel(requests: Sequence[CancelRequest]) -> int:
        if disk_full[0]:
            raise full
        return 0

    ing = DelayTopicIngest(RocketMQConfig(namesrv="127.0.0.1:1"), ContractLimits(10**9, 1 << 20), lambda: 1000,
                           None, monotonic=lambda: t[0])  # type: ignore[arg-type]  # no dead letter here
    ing._schedule, ing._cancel = lambda messages, origins: [], cancel
    ing._accepting.set()
    with caplog.at_level(logging.INFO, logger="timewheel.ingest"):
        for n in range(59):  # 59 s of retries
            assert ing._on_batch([_cancel_message(n)]) is False
            t[0] += 1.0
        [first] = _telling(caplog, "pulled again")
        assert first.exc_info is not None and "No space left on device" in (first.exc_text or "")
        assert "in a row" not in first.getMessage()
        caplog.clear()
        t[0] += 1.0
        assert ing._on_batch([_cancel_message(60)]) is False
        [again] = _telling(caplog, "pulled again")
        assert "(60 in a row over 60 s)" in again.getMessage() and again.exc_info is not None
        caplog.clear()
        disk_full[0] = False
        assert ing._on_batch([_cancel_message(61)]) is True
        assert [r.getMessage() for r in caplog.records] == ["the store takes batches again after 60 failed over 60.0 s"]
        caplog.clear()
        disk_full[0] = True
        assert ing._on_batch([_cancel_message(62)]) is False
        [new_run] = _telling(caplog, "pulled again")
        assert "in a row" not in new_run.getMessage() and new_run.exc_info is not None, "a new run: at once"


@pytest.mark.rocketmq
@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small disk needs root")
def test_a_full_disk_that_stopped_rocksdb_stops_ingest_at_once_once_freed_and_a_restart_stores_it(
        rocketmq: LocalRocketMQ, tmp_path: Path) -> None:
    """RocksDB refuses every write after one failed on a full disk, even once space is freed, until the
    store is reopened: ingest stops at once saying so (not after `consume_refused_max_s` of refusing
    every batch, with the advice to free space that was freed), and the restart stores the message."""
    from tests.storage.test_meta_stopped import _fill, _small_disk

    run, cfg, target = _topics(rocketmq, "f")
    with _small_disk(tmp_path / "disk", 48) as disk:
        settings = Settings(engine=EngineConfig(disk / "data"), rocketmq=cfg)
        service = Service(settings).start()
        try:
            assert wait_for(service.ready, timeout=30)
            engine = service.engine
            assert engine is not None and engine.store is not None
            _fill(disk)
            with pytest.raises(MetaStoreStoppedError):  # what the next checkpoint's flush meets, sooner
                for i in range(64):
                    engine.store.meta.put_document(f"pad{i}", {"pad": "x" * 4096})
                    engine.store.meta.flush()
            with RemotingProducer(rocketmq.namesrv_addr, f"full_producer_{run}") as p:
                [receipt] = p.send([OutgoingMessage(cfg.delay_topic, b"held", None, None,
                                                    {"TW_TARGET_TOPIC": target, "TW_DELAY_MS": "100"})])
            assert isinstance(receipt, Receipt)
            (disk / "filler").unlink()  # the operator frees space: RocksDB still refuses
            assert wait_for(lambda: not service.ready(), timeout=30), service.stats()["ingest"]
            # (a checkpoint meanwhile ends the housekeeping thread too, on the same error)
            assert "ingest-pull-broker-a" in service.dead_threads() and _ingested(service) == 0
            [why] = [w for w in service.not_ready_why() if "ingest-pull-broker-a" in w]
            assert "MetaStoreStoppedError: the meta store" in why and "takes no more writes" in why, why
        finally:
            with contextlib.suppress(Exception):  # its last checkpoint cannot flush the stopped store either
                service.stop()
        _restart_delivers_the_one_message(settings)
