"""`bench.admin_cost` reads each path's answer and charges the CPU it cost to the process named."""
from __future__ import annotations

import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from bench.admin_cost import PATHS, measure


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
