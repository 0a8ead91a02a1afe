"""What the running process says about itself: compiled hot paths, thread names for the OS."""
from __future__ import annotations

import logging
import sys
import threading
from pathlib import Path

import pytest

from timewheel.app import runtime
from timewheel.app.runtime import hot_paths, log_hot_paths, name_os_threads, os_thread_name

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="threads are renamed through /proc")


def test_thread_names_are_shortened_to_what_the_kernel_keeps() -> None:
    assert os_thread_name("timewheel-dispatch-0") == "tw-dispatch-0"
    assert os_thread_name("timewheel-timer") == "tw-timer"
    assert os_thread_name("ingest-pull-broker-a") == "tw-in-broker-a"
    assert os_thread_name("timewheel-housekeeping-and-more") == "tw-housekeeping"  # 15 bytes
    assert len(os_thread_name("x" * 40)) == 15
    assert os_thread_name("timewheel-é") == "tw-?"  # ASCII, whatever the thread was called


def _comm(t: threading.Thread) -> str:
    return Path(f"/proc/self/task/{t.native_id}/comm").read_text().strip()


@linux_only
def test_every_live_thread_gets_its_name_once() -> None:
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="timewheel-probe-thread", daemon=True)
    t.start()
    try:
        assert name_os_threads() >= 1
        assert _comm(t) == "tw-probe-thread"
        assert t.native_id in runtime._named
        assert name_os_threads() == 0  # nothing new: nothing written again
        main = threading.main_thread()
        assert _comm(main) != "MainThread" and main.native_id not in runtime._named  # the process's name
    finally:
        stop.set()
        t.join()
    name_os_threads()
    assert t.native_id not in runtime._named  # an ended thread is forgotten: its id may come back


def test_a_missing_compiled_loop_is_a_warning_that_names_it(monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    from forwarder import record_batches

    assert hot_paths() == {"record_scan": True, "ingest_walk": True, "record_cut": True, "uniq_key": True}  # built by make setup
    with caplog.at_level(logging.INFO, "timewheel.app.runtime"):
        assert all(log_hot_paths().values())
    assert "hot paths compiled" in caplog.text
    caplog.clear()
    monkeypatch.setattr(record_batches, "COMPILED", False)
    with caplog.at_level(logging.INFO, "timewheel.app.runtime"):
        assert log_hot_paths()["record_cut"] is False
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "record_cut" in warnings[0].getMessage()
    assert "record_scan" not in warnings[0].getMessage()
