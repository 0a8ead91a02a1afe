"""The floor under one send: what a message costs at a steady rate when almost nothing but the
kernel, the interpreter's wake-ups and the broker's round trip is left.

    python -m bench.send_floor [--rate 1000] [--seconds 10] [--per-send 1] [--repeat 3] [--out F]

Against a real local RocketMQ, each mode sends `--per-send` messages every 1/(rate/per-send) s:
- bare: one thread sleeps to each tick, writes the engine's own SEND_BATCH_MESSAGE request (recorded
  once from `RemotingProducer`, replayed as bytes) and reads the answer's frame: no encoding, no
  bookkeeping, nothing per message;
- handoff: the same, but a ticking thread wakes a sending thread through a condition each time
  (as the engine's timer wakes its dispatcher);
- producer: one thread sends one stored-shape batch through `RemotingProducer.send_batches` (the
  engine's wire client, cut once, sent again each tick): the forwarder's share on top of bare;
- native: bare's loop in C (`bench/_send_floor_native.c`, built at run time with the system's C
  compiler, called once through ctypes with the interpreter's lock released): the kernel's and the
  broker's share alone, what a compiled send loop could not go below.

Prints, per mode and round, the process's CPU (user + system) and the broker's per message over the
same seconds, then each mode's median. The engine's own figure at the same rate is
`python -m bench.dispatch_pass_cost threads --rate R` (delivery alone) or `bench.peers` (all of it):
the difference is the engine's Python, not the kernel's or the broker's.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import resource
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

try:
    import psutil
except ImportError as e:  # the `bench` extra, which `make setup` does not install
    raise SystemExit("bench.send_floor reads the broker's CPU with psutil: pip install -e '.[bench]'") from e

from forwarder import LocalRocketMQ
from forwarder.record_batches import cut_records
from forwarder.rocketmq import RemotingProducer
from forwarder.rocketmq._send_batch import EncodedBatches
from forwarder.rocketmq.connection import Connection
from forwarder.rocketmq.protocol import SEND_BATCH_MESSAGE, encode_request
from storage import Record, ScheduleStore

TOPIC = "BENCH_FLOOR"


def _record_request(producer: RemotingProducer, per_send: int,
                    data: Path) -> tuple[tuple[int, dict[str, str], bytes], EncodedBatches]:
    """The engine's request for one send of `per_send` stored messages, and the cut batch it came from."""
    now = int(time.time() * 1000)
    with ScheduleStore(data) as store:
        locs = store.append([Record(f"floor-{i}", TOPIC, b"x" * 200, now + 1000) for i in range(per_send)],
                            now).locations
        records = store.read_record_bytes(locs["segment_ms"].astype(np.int64), locs["part"].astype(np.uint16),
                                          locs["offset"].astype(np.uint32))
    cut = cut_records(records, producer.new_ids, max_message=producer.max_message_bytes,
                      max_count=producer.max_batch_messages, max_bytes=producer.max_batch_bytes)
    seen: list[tuple[int, dict[str, str], bytes]] = []
    submit = Connection.submit

    def recording(self: Connection, requests: Sequence[tuple[int, Mapping[str, str], bytes]],
                  deadline: float, fence: Callable[[], bool] | None = None) -> list[int]:
        seen.extend((c, dict(e), b) for c, e, b in requests)
        return submit(self, requests, deadline, fence)

    Connection.submit = recording  # type: ignore[method-assign]
    try:
        errors = producer.send_batches(cut)
    finally:
        Connection.submit = submit  # type: ignore[method-assign]
    sends = [r for r in seen if r[0] == SEND_BATCH_MESSAGE]  # the route look-up goes first
    if len(sends) != 1 or any(errors):
        raise RuntimeError(f"expected one send stored for one batch, saw {len(sends)}: {errors}")
    return sends[0], cut


def _read_frame(sock: socket.socket, buf: bytearray) -> None:
    """Read one whole response frame (length-prefixed) and drop it."""
    while True:
        if len(buf) >= 4:
            n = struct.unpack_from(">I", buf)[0] + 4
            if len(buf) >= n:
                del buf[:n]
                return
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("the broker closed the connection")
        buf += chunk


def _ticks(rate_sends: float, seconds: float) -> Callable[[], bool]:
    """A pacer: each call sleeps to the next tick; False once `seconds` are over."""
    period = 1.0 / rate_sends
    start = time.monotonic()
    state = {"k": 0}

    def wait() -> bool:
        state["k"] += 1
        due = start + state["k"] * period
        if due - start > seconds:
            return False
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        return True

    return wait


def _bare(addr: str, frame: bytes, rate_sends: float, seconds: float) -> int:
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray()
        wait, sends = _ticks(rate_sends, seconds), 0
        while wait():
            sock.sendall(frame)
            _read_frame(sock, buf)
            sends += 1
    return sends


def _handoff(addr: str, frame: bytes, rate_sends: float, seconds: float) -> int:
    host, port = addr.rsplit(":", 1)
    cond = threading.Condition()
    state = {"ticks": 0, "done": False}

    def ticker() -> None:
        wait = _ticks(rate_sends, seconds)
        while wait():
            with cond:
                state["ticks"] += 1
                cond.notify()
        with cond:
            state["done"] = True
            cond.notify()

    sends = 0
    with socket.create_connection((host, int(port))) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray()
        t = threading.Thread(target=ticker, name="floor-tick", daemon=True)
        t.start()
        while True:
            with cond:
                while not state["ticks"] and not state["done"]:
                    cond.wait()
                if not state["ticks"]:
                    break
                state["ticks"] -= 1
            sock.sendall(frame)
            _read_frame(sock, buf)
            sends += 1
        t.join()
    return sends


def _native_loop(work: Path) -> Callable[[int, bytes, int, int, float], int]:
    """`floor_loop` of `_send_floor_native.c`, built into `work` with the system's C compiler."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    if cc is None:
        raise RuntimeError("the native mode needs a C compiler (cc, or CC=...) on the PATH")
    lib = work / "send_floor_native.so"
    subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(Path(__file__).with_name("_send_floor_native.c"))],
                   check=True)
    fn = ctypes.CDLL(str(lib)).floor_loop  # a CDLL call releases the interpreter's lock while it runs
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_long, ctypes.c_long, ctypes.c_double]
    fn.restype = ctypes.c_long
    return fn


def _native(loop: Callable[[int, bytes, int, int, float], int], addr: str, frame: bytes, rate_sends: float,
            seconds: float) -> int:
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sends = loop(sock.fileno(), frame, len(frame), int(1e9 / rate_sends), seconds)
    if sends < 0:
        raise OSError(-sends, os.strerror(-sends))
    return sends


def _producer(producer: RemotingProducer, cut: EncodedBatches, rate_sends: float, seconds: float) -> int:
    wait, sends = _ticks(rate_sends, seconds), 0
    while wait():
        errors = producer.send_batches(cut)
        if any(errors):
            raise RuntimeError(f"a send failed: {errors}")
        sends += 1
    return sends


def _cpu(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def run(mq: LocalRocketMQ, data: Path, rate: int, seconds: float, per_send: int, modes: Sequence[str],
        repeat: int = 3, warm_up: float = 10.0) -> list[dict[str, object]]:
    """Each mode's CPU per message (this process and the broker) at `rate` messages a second, the
    modes interleaved `repeat` times after `warm_up` seconds of bare sends."""
    producer = RemotingProducer(mq.namesrv_addr, "bench-floor")
    try:
        (code, ext, body), cut = _record_request(producer, per_send, data)
        frame = encode_request(code, 1, ext, body)  # as the engine writes it; one request in flight at a time
        broker = psutil.Process(mq.broker_pid) if mq.broker_pid else None
        native = _native_loop(data.parent) if "native" in modes else None
        rate_sends = rate / per_send
        _bare(mq.broker_addr, frame, rate_sends, warm_up)  # the broker's JIT warms up on this path first
        rows = []
        for mode in [m for _ in range(repeat) for m in modes]:  # interleaved: a drifting machine hits all alike
            r0, b0, w0 = resource.getrusage(resource.RUSAGE_SELF), _cpu(broker) if broker else 0.0, time.monotonic()
            if mode == "bare":
                sends = _bare(mq.broker_addr, frame, rate_sends, seconds)
            elif mode == "handoff":
                sends = _handoff(mq.broker_addr, frame, rate_sends, seconds)
            elif mode == "native":
                assert native is not None
                sends = _native(native, mq.broker_addr, frame, rate_sends, seconds)
            else:
                sends = _producer(producer, cut, rate_sends, seconds)
            r1, b1, w1 = resource.getrusage(resource.RUSAGE_SELF), _cpu(broker) if broker else 0.0, time.monotonic()
            cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
            msgs = sends * per_send
            rows.append({"mode": mode, "rate": rate, "per_send": per_send, "sends": sends,
                         "seconds": round(w1 - w0, 2),
                         "cpu_us_per_msg": round(cpu / msgs * 1e6, 1),
                         "user_us_per_msg": round((r1.ru_utime - r0.ru_utime) / msgs * 1e6, 1),
                         "system_us_per_msg": round((r1.ru_stime - r0.ru_stime) / msgs * 1e6, 1),
                         "broker_cpu_us_per_msg": round((b1 - b0) / msgs * 1e6, 1) if broker else None})
            print(json.dumps(rows[-1]))
            sys.stdout.flush()
        return rows
    finally:
        producer.close()


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: see the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=int, default=1000, help="messages a second")
    ap.add_argument("--seconds", type=float, default=10.0, help="for how long each mode runs")
    ap.add_argument("--per-send", type=int, default=1, help="messages in each send")
    ap.add_argument("--mode", action="append", choices=["bare", "handoff", "producer", "native"],
                    help="run only this mode (repeatable; default all)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of all modes, interleaved")
    ap.add_argument("--warm-up", type=float, default=10.0, help="seconds of bare sends first (the broker's JIT)")
    ap.add_argument("--out", type=Path, help="also write the rows here as JSON")
    args = ap.parse_args(argv)
    modes = args.mode or ["bare", "handoff", "producer", "native"]
    work = Path(tempfile.mkdtemp(prefix="tw-floor-"))
    with LocalRocketMQ(work / "mq", stop_timeout=3.0) as mq:
        mq.create_topics([TOPIC], queues=8)
        rows = run(mq, work / "data", args.rate, args.seconds, args.per_send, modes, args.repeat, args.warm_up)
    for mode in modes:
        cpu = sorted(float(r["cpu_us_per_msg"]) for r in rows if r["mode"] == mode)  # type: ignore[arg-type]
        print(f"{mode:>9}: CPU a message {cpu[len(cpu) // 2]:.1f} µs (median of {len(cpu)}; {cpu[0]:.1f}–{cpu[-1]:.1f})")
    if args.out:
        args.out.write_text(json.dumps({"command": " ".join(["python -m bench.send_floor", *sys.argv[1:]]), "load_average": os.getloadavg(), "rows": rows},
                                       indent=1))

if __name__ == "__main__":
    main()
