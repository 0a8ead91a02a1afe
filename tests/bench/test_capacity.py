"""`bench.capacity`'s model says when its delivery fit was taken through an engine that fell behind."""
from __future__ import annotations

from pathlib import Path

import pytest

from bench.capacity import BEHIND_P99_MS, fit_fell_behind, markdown


def _measured(p99_10k: float, p99_1k: float) -> dict:
    return {"low_due_rate": 1000,
            "delivery": {"due_per_s": 10_000, "cpu_us_per_message": 19.0, "lateness_ms": {"p99": p99_10k}},
            "delivery_1000": {"due_per_s": 1000, "cpu_us_per_message": 400.0, "lateness_ms": {"p99": p99_1k}},
            "delivery_5000": {"due_per_s": 5000, "cpu_us_per_message": 60.0, "lateness_ms": {"p99": 9_999.0}}}


def test_only_the_fits_own_phases_count_and_only_past_the_bound() -> None:
    assert fit_fell_behind(_measured(8_000.0, 20.0)) == [10_000]
    assert fit_fell_behind(_measured(BEHIND_P99_MS, 20.0)) == [], "at the bound it kept up"
    assert fit_fell_behind(_measured(90.0, 20.0)) == [], "a check rate falling behind does not move the fit"
    assert fit_fell_behind({"delivery": {"due_per_s": 10_000}}) == [], "a run without lateness says nothing"


def test_the_table_tells_the_reader_not_to_size_from_a_saturated_fit() -> None:
    from pathlib import Path

    from bench.capacity import _linger, model
    from timewheel.config import EngineConfig

    measured = {**_measured(8_000.0, 20.0), "ingest": {"per_s": 9000, "cpu_us_per_message": 24.0,
                                                       "disk_bytes_per_message": 356.0, "body_bytes": 200},
                "loaded": {"rss_bytes_per_entry": 14.5, "wheel_bytes_per_entry": 16.0},
                "idle": {"cpu_cores": 0.02, "rss_mb": 70.0}}
    out = {"machine": {}, "measured": measured, "model": model(measured, EngineConfig(Path("data")), _linger({}))}
    assert out["model"]["fit_fell_behind_at_due_per_s"] == [10_000]
    assert "**Do not size from this fit.** The engine fell behind at 10,000 due a second" in markdown(out)
    measured["delivery"]["lateness_ms"]["p99"] = 90.0
    assert "Do not size" not in markdown(out)


def test_another_revisions_engine_must_be_a_checkout_and_not_a_replica_set(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bench.capacity import main

    with pytest.raises(SystemExit):
        main(["--engine-tree", str(tmp_path)])
    assert "is not a timewheel checkout" in capsys.readouterr().err
    (tmp_path / "timewheel").mkdir()
    (tmp_path / "timewheel" / "__main__.py").write_text("")
    with pytest.raises(SystemExit):
        main(["--engine-tree", str(tmp_path), "--ha"])
    assert "drop --engine-tree or --ha" in capsys.readouterr().err


def test_the_lease_is_read_from_the_engines_status_not_its_log() -> None:
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from bench.capacity import holds_lease

    answers = [(503, {"error": "starting"}), (200, {"serving": True}),
               (200, {"ha": {"replica": {"holder": False, "epoch": 0}}}),
               (200, {"ha": {"replica": {"holder": True, "epoch": 3}}})]

    class _Status(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            code, doc = answers.pop(0) if self.path == "/status" else (404, {})
            body = json.dumps(doc).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Status)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        admin = f"127.0.0.1:{server.server_address[1]}"
        said: list[str] = []
        # a 503 while it starts is "not yet", not the end of the run; what it said is kept for the message
        assert [holds_lease(admin, said) for _ in range(4)] == [False, False, False, True]
        assert len(said) == 1 and "HTTP 503" in said[0] and "starting" in said[0], said
    finally:
        server.shutdown()
        server.server_close()
