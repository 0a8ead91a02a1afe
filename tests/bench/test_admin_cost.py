"""`bench.admin_cost` reads each path's answer and charges the CPU it cost to the process named."""
from __future__ import annotations

import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench import admin_cost
from bench.admin_cost import PATHS, idle_threads, measure
from bench.peers.common import thread_usage


def test_each_path_is_read_and_the_cpu_of_the_process_named_is_charged_to_it() -> None:
    served: list[str] = []

    class _Admin(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            served.append(self.path)
            if self.path == "/metrics":  # a dear answer: its CPU is this process's, the one measured
                sum(i * i for i in range(200_000))
            body = self.path.encode() * 10
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Admin)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        rows = measure(f"http://127.0.0.1:{server.server_address[1]}", os.getpid(), 5)
    finally:
        server.shutdown()
        server.server_close()
    assert [p for p, _, _ in rows] == list(PATHS)
    assert [size for _, _, size in rows] == [len(p) * 10 for p in PATHS]
    assert sorted(set(served)) == sorted(PATHS) and len(served) == 3 * (5 + 20)
    by_path = {p: ms for p, ms, _ in rows}
    assert by_path["/metrics"] > by_path["/healthz"] >= 0


def test_an_idle_thread_is_charged_its_own_cpu_and_wakes_under_the_name_it_gave_the_os() -> None:
    stop = threading.Event()

    def wake_and_burn() -> None:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as comm:
            comm.write("tw-bench-waker")
        while not stop.wait(0.01):  # a hundred wakes a second, each with some work
            sum(i * i for i in range(20_000))

    t = threading.Thread(target=wake_and_burn, daemon=True)
    t.start()
    try:
        rows = {name: (ms, wakes) for name, ms, wakes in idle_threads(os.getpid(), 1.0)}
        mine = thread_usage(os.getpid())  # while it runs: an ended thread is left out
    finally:
        stop.set()
        t.join()
    ms, wakes = rows["tw-bench-waker"]
    # about 100: a wait that timed out is one each (fewer on a busy machine; waits for the GIL add some)
    assert 10 <= wakes <= 400, rows
    assert ms > 0, rows
    tid = t.native_id
    assert tid is not None and mine[tid][0] == "tw-bench-waker" and mine[tid][2] >= wakes, mine


def test_a_thread_renamed_or_started_in_the_window_is_charged_only_what_it_did_in_the_window(
        monkeypatch: pytest.MonkeyPatch) -> None:
    readings = iter([
        {1: ("python", 5.0, 100), 2: ("tw-timer", 1.0, 50), 3: ("tw-gone", 2.0, 7)},
        # thread 1 named itself meanwhile (its 5 s before are not the window's); 4 started; 3 ended
        {1: ("tw-dispatch-0", 5.1, 110), 2: ("tw-timer", 1.0, 70), 4: ("tw-dispatch-1", 0.2, 3)},
    ])
    monkeypatch.setattr(admin_cost, "thread_usage", lambda pid: next(readings))
    monkeypatch.setattr(admin_cost.time, "sleep", lambda s: None)
    rows = {name: (round(ms, 6), wakes) for name, ms, wakes in admin_cost.idle_threads(123, 2.0)}
    assert rows == {"tw-dispatch-0": (50.0, 5.0), "tw-dispatch-1": (100.0, 1.5), "tw-timer": (0.0, 10.0)}

