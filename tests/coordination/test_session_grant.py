"""A ZooKeeper whose own session bounds differ from `ha.session_timeout_s`: it grants a session within
its `minSessionTimeout`..`maxSessionTimeout`, and expires the holder's lease after the session it
granted, so the holder's fence must be measured against that one, not against the one it asked for."""
from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from coordination import HAConfig, LocalZooKeeper, ShardReplica
from tests.coordination.cluster import wait_for

pytestmark = pytest.mark.zookeeper  # starts one of its own, with a short maxSessionTimeout

MAX_SESSION_MS = 2_000


class _ShortSessionZooKeeper(LocalZooKeeper):
    """A local ZooKeeper that grants sessions of at most MAX_SESSION_MS (the later key of zoo.cfg wins)."""

    def _write_config(self, port: int) -> None:
        super()._write_config(port)
        with (self.run_dir / "zoo.cfg").open("a") as cfg:
            cfg.write(f"maxSessionTimeout={MAX_SESSION_MS}\n")


@pytest.fixture
def short_zk(tmp_path: Path) -> Iterator[LocalZooKeeper]:
    """The test's own ZooKeeper, granting sessions of at most MAX_SESSION_MS."""
    server = _ShortSessionZooKeeper(tmp_path / "zk").start()
    yield server
    server.stop()


def test_a_holder_fences_itself_within_the_session_zookeeper_granted_not_the_longer_one_it_asked(
        short_zk: LocalZooKeeper, caplog: pytest.LogCaptureFixture) -> None:
    cfg = HAConfig(zookeeper=short_zk.connect_string, replica_id="a", session_timeout_s=10.0, fence_fraction=0.9,
                   watermark_interval_s=0.2)
    a = ShardReplica(cfg, f"TW_DELAY_{uuid.uuid4().hex[:8]}", now_ms=lambda: time.time_ns() // 1_000_000)
    a.start(lambda: 0)
    try:
        wait_for("a holds the lease", a.may_send)
        # ZooKeeper expires a's session (and a standby takes over) MAX_SESSION_MS after a's last
        # request: a fence reaching past that lets both send
        assert a.fence.session_timeout_s == MAX_SESSION_MS / 1000
        assert a.fence.remaining_s() <= cfg.fence_fraction * MAX_SESSION_MS / 1000
        assert any("granted a session of 2 s where ha.session_timeout_s asks for 10 s" in r.getMessage()
                   for r in caplog.records)
    finally:
        a.stop()
