"""Hostile input: arbitrary bytes in every file the loader reads, and admin requests from outside."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from storage import ScheduleStore, SegmentLayout, check, read_dispatch_log, summarize
from timewheel.app.admin import AdminServer
from timewheel.loader import SegmentLoader
from timewheel.app.settings import AdminConfig

T0 = 1_800_000_000_000


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(idx=st.binary(max_size=400), log=st.binary(max_size=400), dispatch=st.binary(max_size=400))
def test_arbitrary_bytes_never_crash_the_loader(tmp_path_factory: pytest.TempPathFactory, idx: bytes, log: bytes,
                                                dispatch: bytes) -> None:
    root = tmp_path_factory.mktemp("fuzz")
    layout = SegmentLayout(root)
    seg = layout.segment_start(T0)
    layout.segment_dir(seg).mkdir(parents=True)
    layout.part_log(seg, 0).write_bytes(log)
    layout.part_index(seg, 0).write_bytes(idx)
    layout.dispatch_log(seg).write_bytes(dispatch)
    read_dispatch_log(layout.dispatch_log(seg))
    summarize(layout)
    check(layout)
    with ScheduleStore(root) as store:  # recovery repairs or cuts whatever it finds
        loader = SegmentLoader(store)
        due, refs = loader.load(seg)
        s, p, o = loader.locate(refs)
        for rec in store.read_records(s.tolist(), p.tolist(), o.tolist()):
            assert rec is not None  # a Record, or the CorruptRecordError in its place: never a crash


class _Target:
    def ready(self) -> bool:
        return True

    def not_ready_why(self) -> list[str]:
        return []

    def cancel(self, msg_id: str | None, key: str | None) -> int:
        raise AssertionError("a refused request must not reach the engine")

    def find_messages(self, msg_id: str | None, key: str | None, limit: int) -> dict[str, object]:
        return {"found": []}

    def stats(self) -> dict[str, object]:
        return {}

    def status(self) -> dict[str, object]:
        return {}

    def shaping_rules(self) -> dict[str, object]:
        return {}

    def replace_shaping_rules(self, rules: dict[str, object]) -> dict[str, object]:
        raise AssertionError("a refused request must not reach the engine")


def test_admin_listens_on_loopback_by_default_and_guards_mutations() -> None:
    assert AdminConfig().listen.startswith("127.0.0.1:")
    server = AdminServer("127.0.0.1:0", "tok", _Target(), CollectorRegistry()).start()
    try:
        assert server.address.startswith("127.0.0.1:")
        base = f"http://{server.address}"
        for path in ("/../../etc/passwd", "/%2e%2e/%2e%2e/etc/passwd", "/metrics/../../x", "/data/../meta"):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(base + path, timeout=5)
            assert e.value.code == 404
        for method, path in (("POST", "/cancel?id=x"), ("PUT", "/shaping")):
            for auth in (None, "Bearer nope", "Basic dG9rOg==", "Bearer tok2"):
                req = urllib.request.Request(base + path, method=method, data=b"{}",
                                             headers={"Authorization": auth} if auth else {})
                with pytest.raises(urllib.error.HTTPError) as e:
                    urllib.request.urlopen(req, timeout=5)
                assert e.value.code == 401
        assert json.loads(urllib.request.urlopen(base + "/healthz", timeout=5).read()) == {"status": "ok"}
    finally:
        server.stop()


def test_without_a_token_mutations_are_disabled() -> None:
    server = AdminServer("127.0.0.1:0", "", _Target(), CollectorRegistry()).start()
    try:
        req = urllib.request.Request(f"http://{server.address}/cancel?id=x", method="POST",
                                     headers={"Authorization": "Bearer "})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=5)
        assert e.value.code == 403
    finally:
        server.stop()


def test_inspect_reads_only_a_data_directory(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from timewheel.app.cli import app

    (tmp_path / "etc").mkdir()
    res = CliRunner().invoke(app, ["inspect", "--data-dir", str(tmp_path / "etc" / ".." / "etc")])
    assert res.exit_code == 2
    assert not list((tmp_path / "etc").iterdir()), "inspect must not create anything"
