"""A replica names the error that ended its thread only once the thread has ended: `thread_failures`
gives the errors of the threads `dead_threads` names, so that a caller reading one after the other
(the service's `/readyz`) never sees an error without its dead thread, nor the other way round."""
from __future__ import annotations

import threading

import pytest

from coordination import HAConfig, ShardReplica


def test_the_error_is_named_with_the_dead_thread_not_a_moment_before(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = HAConfig(zookeeper="127.0.0.1:1", replica_id="a")  # never connected: the loop is replaced below
    r = ShardReplica(cfg, "TW_DELAY", now_ms=lambda: 0)
    revoking, go_on = threading.Event(), threading.Event()

    def contend() -> None:
        raise RuntimeError("the lease path was deleted")

    def slow_revoke() -> None:  # what the thread does between recording its error and ending
        revoking.set()
        go_on.wait(10)

    monkeypatch.setattr(r, "_contend", contend)
    monkeypatch.setattr(r.fence, "revoke", slow_revoke)
    r._thread = threading.Thread(target=r._run, name="timewheel-replica", daemon=True)
    r._thread.start()
    try:
        assert revoking.wait(10)
        assert r.dead_threads() == [] and r.thread_failures() == {}, "an error named while its thread still runs"
    finally:
        go_on.set()
        r._thread.join(10)
    assert r.dead_threads() == ["timewheel-replica"]
    assert r.thread_failures() == {"timewheel-replica": "RuntimeError: the lease path was deleted"}
