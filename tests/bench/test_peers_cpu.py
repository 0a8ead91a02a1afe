"""The steady window of a phase's CPU samples."""
from __future__ import annotations

from pathlib import Path

from bench.peers.cpu import CpuSampler, steady_window


class _Quiet:
    name = "timewheel"

    def process_pids(self) -> list[int]:
        return []


def _sampler(samples: list[tuple[float, float, float]]) -> CpuSampler:
    s = CpuSampler(_Quiet())  # type: ignore[arg-type]
    s.samples = [(t, {"1 python": e, "2 broker": b}, {11: ("tw-dispatch-0", e / 2, 0)},
                  {"1 python": e / 10, "2 broker": b / 8}) for t, e, b in samples]
    return s


def test_the_window_is_the_stream_s_last_seconds_once_all_it_sends_comes_due() -> None:
    # 25 s of stream, delays up to 10 s: the steady part is the last 13 s (2 s of slack)
    samples = [(float(t), t * 1.0 + (5.0 if t > 25 else 0.0), t * 4.0) for t in range(0, 36)]
    w = steady_window(_sampler(samples), 25.0, 25.0, 10.0)
    assert w is not None
    assert w["seconds"] == 13.0
    assert w["server_cpu_s"] == {"1 python": 13.0, "2 broker": 52.0}, "the drain after 25 s is left out"
    assert w["engine_threads_cpu_s"] == {"tw-dispatch": 6.5}
    assert w["run_queue_s"] == {"1 python": 1.3, "2 broker": 6.5}, "the run queue's waits in the same window"


def test_threads_are_charged_by_id_what_they_did_inside_the_window() -> None:
    s = _sampler([(float(t), float(t), float(t)) for t in range(4)])
    # thread 21 runs unnamed for 5 s, then names itself tw-timer inside the window and spends 0.5 more;
    # thread 22 starts inside it; thread 23 ends inside it, after 0.25 s there
    threads = [{21: ("python", 5.0, 0), 23: ("tw-in-broker-a", 1.0, 0)},
               {21: ("python", 5.0, 0), 23: ("tw-in-broker-a", 1.25, 0)},
               {21: ("tw-timer", 5.5, 0), 22: ("tw-dispatch-1", 0.75, 0)},
               {21: ("tw-timer", 5.5, 0), 22: ("tw-dispatch-1", 1.0, 0)}]
    s.samples = [(t, c, {**h, **threads[k]}, q) for k, (t, c, h, q) in enumerate(s.samples)]
    w = s.window(0.0, 3.0)
    assert w is not None
    assert w["engine_threads_cpu_s"] == {"tw-dispatch": 2.5, "tw-in": 0.25, "tw-timer": 0.5}, \
        "named in the window: only what it did there; started there: all; ended there: to its last sample"


def test_a_stream_too_short_for_a_steady_part_has_no_window() -> None:
    assert steady_window(_sampler([(0.0, 0.0, 0.0), (10.0, 1.0, 1.0)]), 10.0, 10.0, 10.0) is None


def test_a_window_with_fewer_than_two_samples_is_none() -> None:
    assert _sampler([(0.0, 0.0, 0.0), (30.0, 1.0, 1.0)]).window(10.0, 20.0) is None


def test_the_run_queue_of_a_process_counts_its_threads_and_its_childrens() -> None:
    import os
    import subprocess
    import sys

    from bench.peers.cpu import run_queue_seconds
    from bench.stage_cpu import run_queue_ns

    class Me:
        name = "timewheel"

        def process_pids(self) -> list[int]:
            return [os.getpid()]

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        before = run_queue_ns()
        [(key, waited)] = run_queue_seconds(Me()).items()  # type: ignore[arg-type]
        assert key == f"{os.getpid()} {Path(f'/proc/{os.getpid()}/comm').read_text().strip()}"
        assert waited >= before / 1e9, "at least this thread's own wait"
        from bench.peers.cpu import _process_tree
        assert child.pid in _process_tree(os.getpid()), "children's threads count too"
    finally:
        child.kill()
        child.wait()


def test_the_engines_threads_are_read_by_the_name_they_gave_the_os_siblings_summed() -> None:
    import os
    import threading
    import time

    from bench.peers.cpu import thread_readings, threads_between

    class Me:
        name = "timewheel"

        def process_pids(self) -> list[int]:
            return [os.getpid()]

    stop = threading.Event()
    burnt = [threading.Event() for _ in range(3)]

    def burn(comm: str, seconds: float, done: threading.Event) -> None:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write(comm)
        start = time.thread_time()
        while time.thread_time() - start < seconds:
            pass
        done.set()
        stop.wait(10)  # alive while read: an ended thread is no longer in /proc

    threads = [threading.Thread(target=burn, args=(comm, s, done), daemon=True)
               for (comm, s), done in zip((("tw-dispatch-0", 0.1), ("tw-dispatch-1", 0.1), ("tw-in-broker-a", 0.2)),
                                          burnt)]
    for t in threads:
        t.start()
    try:
        assert all(done.wait(10) for done in burnt)
        got = threads_between({}, thread_readings(Me()))  # type: ignore[arg-type]
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert set(got) == {"tw-dispatch", "tw-in"}, "the main thread and other threads are not the engine's"
    assert 0.15 <= got["tw-dispatch"] <= 0.4 and 0.15 <= got["tw-in"] <= 0.4, got


def test_a_phase_charges_a_thread_named_during_it_only_what_it_did_after() -> None:
    import os
    import threading
    import time

    from bench.peers.cpu import thread_readings, threads_between

    class Me:
        name = "timewheel"

        def process_pids(self) -> list[int]:
            return [os.getpid()]

    burnt, named, go, stop = threading.Event(), threading.Event(), threading.Event(), threading.Event()

    def burn(seconds: float) -> None:
        start = time.thread_time()
        while time.thread_time() - start < seconds:
            pass

    def worker() -> None:
        burn(0.3)  # unnamed: before the phase
        burnt.set()
        go.wait(10)
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write("tw-timer")
        burn(0.1)
        named.set()
        stop.wait(10)

    t = threading.Thread(target=worker, daemon=True)
    t.start()
    try:
        assert burnt.wait(10)
        before = thread_readings(Me())  # type: ignore[arg-type]
        go.set()
        assert named.wait(10)
        got = threads_between(before, thread_readings(Me()))  # type: ignore[arg-type]
    finally:
        stop.set()
        t.join()
    assert 0.05 <= got.get("tw-timer", 0.0) <= 0.25, got
