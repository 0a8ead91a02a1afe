"""Fixtures shared by every test package."""

from __future__ import annotations

import gc
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest

from coordination.local_zookeeper import LocalZooKeeper
from forwarder.local_rocketmq import LocalRocketMQ


#: the real parts a test may start, by the fixture that starts them, and the marker that says so
_REAL_PARTS = {"rocketmq": "rocketmq", "zookeeper": "zookeeper", "spark": "spark"}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test with the real parts its fixtures start, directly or through another fixture,
    so that `-m "not rocketmq and not zookeeper and not spark"` runs only what needs none of them."""
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        for fixture, marker in _REAL_PARTS.items():
            if fixture in used and item.get_closest_marker(marker) is None:
                item.add_marker(marker)


@pytest.fixture(scope="session")
def rocketmq() -> Iterator[LocalRocketMQ]:
    """A real Apache RocketMQ (NameServer + Broker on loopback) shared by the whole session."""
    # The store goes away with the temporary run directory, so a graceful stop at the end (10-15 s
    # of broker shutdown hooks) buys nothing: SIGKILL after a short grace period.
    mq = LocalRocketMQ(stop_timeout=3.0)
    mq.start()
    try:
        yield mq
    finally:
        mq.stop()


@pytest.fixture(scope="session")
def zookeeper() -> Iterator[LocalZooKeeper]:
    """A real Apache ZooKeeper (standalone, on loopback) shared by the whole session."""
    zk = LocalZooKeeper().start()
    try:
        yield zk
    finally:
        zk.stop()


#: kazoo runs a client's connection in a thread it names after this function
_KAZOO_CONNECTION_THREAD = "(zk_loop)"
_LEFT_RUNNING_GRACE_S = 5.0
_reported_left_running: set[int | None] = set()


@pytest.fixture(autouse=True)
def _no_zookeeper_client_left_running() -> Iterator[None]:
    """Fails the test after which a ZooKeeper client still runs (each such client once, at the test that left it)."""
    # A client left reconnecting to a ZooKeeper that is gone draws on the `random` module from its
    # thread for ever, and hypothesis then fails unrelated property tests for "using random inside a
    # strategy". This names the test that left it instead.
    yield
    deadline = time.monotonic() + _LEFT_RUNNING_GRACE_S
    while True:
        left = [t for t in threading.enumerate()
                if t.name.endswith(_KAZOO_CONNECTION_THREAD) and t.ident not in _reported_left_running]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if left:
        _reported_left_running.update(t.ident for t in left)
        pytest.fail(f"a ZooKeeper client still runs after this test ({', '.join(t.name for t in left)}): "
                    "stop and close every client it started, on every path")


# Opt-in descriptor audit. A test that never closes its writers or stores can hold thousands of
# descriptors until the garbage collector gets to them, and the tests after it fail with EMFILE far
# from the cause. With TIMEWHEEL_FD_AUDIT=<file> every test whose count of /proc/self/fd grew
# appends a line there; unset, the fixture is not even defined, so a normal run pays nothing.
_FD_AUDIT_PATH = os.environ.get("TIMEWHEEL_FD_AUDIT")
_FD_DIR = "/proc/self/fd"
_FD_SAMPLE = 4


def _open_fds() -> dict[int, str]:
    """The process's descriptors and what each points to, after a garbage collection."""
    # Collect first: an object dropped without close() still holds its descriptor until collected,
    # and only what survives collection is a leak rather than garbage not yet freed.
    gc.collect()
    out: dict[int, str] = {}
    for name in os.listdir(_FD_DIR):
        try:
            out[int(name)] = os.readlink(f"{_FD_DIR}/{name}")
        except OSError:  # the descriptor listdir itself used, or one closed by another thread
            continue
    return out


def _fd_sample(before: dict[int, str], after: dict[int, str]) -> str:
    """The targets of the descriptors in `after` that `before` lacks, the commonest first."""
    new = Counter(target for fd, target in after.items() if before.get(fd) != target)
    return "; ".join(f"{target} x{n}" if n > 1 else target for target, n in new.most_common(_FD_SAMPLE))


def _wider_fixtures(request: pytest.FixtureRequest) -> str:
    """The session-, package-, module- and class-scoped fixtures the test uses, by name."""
    # Those open their sockets and files once, for the first test that uses them (a broker, Spark,
    # ZooKeeper): a line naming them may be that and not a leak of the test itself.
    info = request.node._fixtureinfo  # pytest has no public closure with scopes
    names = []
    for name in info.names_closure:
        defs = info.name2fixturedefs.get(name)
        if defs and defs[-1].scope != "function" and not name.startswith("_fd_audit"):
            names.append(f"{name}({defs[-1].scope})")
    return ",".join(names) or "-"


def _fd_line(nodeid: str, phase: str, delta: int, fixtures: str, sample: str) -> None:
    """Append one line of the audit: tab-separated, to sort or grep."""
    assert _FD_AUDIT_PATH is not None
    with open(_FD_AUDIT_PATH, "a", encoding="utf-8") as f:
        f.write(f"{nodeid}\t{phase}\t{delta:+d}\tfixtures={fixtures}\t{sample}\n")


if _FD_AUDIT_PATH:
    _fd_last: list[dict[int, str]] = []  # the count at the end of the previous test

    @pytest.fixture(scope="session", autouse=True)
    def _fd_audit_session() -> Iterator[None]:
        """Appends the session's net change once every fixture is torn down (set up first, so last)."""
        # Module- and session-scoped fixtures are torn down after the last test that uses them has
        # been counted: only this line shows whether they gave back what they opened.
        before = _open_fds()
        _fd_last[:] = [before]  # so the first test's wider fixtures are reported as its "setup" too
        yield
        after = _open_fds()
        _fd_line("<session>", "net", len(after) - len(before), "-", _fd_sample(before, after))

    @pytest.fixture(autouse=True)
    def _fd_audit(request: pytest.FixtureRequest) -> Iterator[None]:
        """Appends to $TIMEWHEEL_FD_AUDIT a line per test that ends with more descriptors open."""
        before = _open_fds()
        lines = []
        # Wider-scoped fixtures are set up before this one, so what they opened shows between the
        # end of the previous test and the start of this one: reported apart, as "setup".
        if _fd_last and len(before) > len(_fd_last[-1]):
            lines.append((request.node.nodeid, "setup", len(before) - len(_fd_last[-1]),
                          _fd_sample(_fd_last[-1], before)))
        yield
        after = _open_fds()
        if len(after) > len(before):
            lines.append((request.node.nodeid, "test", len(after) - len(before), _fd_sample(before, after)))
        _fd_last[:] = [after]
        if lines:
            wider = _wider_fixtures(request)
            for nodeid, phase, delta, sample in lines:
                _fd_line(nodeid, phase, delta, wider, sample)
