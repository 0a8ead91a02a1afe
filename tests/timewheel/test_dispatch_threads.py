"""Several dispatch threads (a sink with max_in_flight > 1) send side by side only when a batch is full.

Real clock and threads: the point is what the threads do while a send is in flight.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable, Sequence

import pytest

from tests.polling import wait_for
from timewheel import Engine, EngineConfig, ManualClock, Message
from tests.timewheel.conftest import T0, RecordingSink


class RoundTripSink:
    """Each send takes 5 ms, as a broker's round trip does; records how many overlap and their sizes."""

    max_in_flight = 4

    def __init__(self, linger_ms: int) -> None:
        self.linger_ms = linger_ms
        self.lock = threading.Lock()
        self.in_flight = 0
        self.most_in_flight = 0
        self.beside = 0  # sends that started while another was in flight
        self.delay_s = 0.005
        self.sizes: list[int] = []
        self.ids: list[str] = []

    def send_batch(self, messages: Sequence[Message]) -> list[bool]:
        with self.lock:
            self.beside += self.in_flight > 0
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        time.sleep(self.delay_s)
        with self.lock:
            self.in_flight -= 1
            self.sizes.append(len(messages))
            self.ids += [m.msg_id or "" for m in messages]
        return [True] * len(messages)


@pytest.mark.parametrize("linger_ms", [0, 2])
def test_a_trickle_goes_one_send_at_a_time_and_a_burst_in_parallel(tmp_path: Path, linger_ms: int) -> None:
    sink = RoundTripSink(linger_ms)
    with Engine(EngineConfig(data_dir=tmp_path / "data", send_batch_size=1000), sink) as engine:
        now = time.time_ns() // 1_000_000
        # 2,000 a second for a second: a few come due during each 5 ms send
        engine.schedule([Message("T", b"x", now + 300 + i // 2, msg_id=f"t{i}") for i in range(2000)])
        assert wait_for(lambda: len(sink.ids) == 2000, 30)
        trickle_beside, trickle_sends = sink.beside, len(sink.sizes)
        # 10,000 due at one millisecond: full batches, sent side by side. A send of 1,000 takes a
        # broker tens of ms; with 5 ms ones, reading the next batch's records (a few ms of CPU on a
        # busy 2-core machine) could outlast the send in flight, and nothing would overlap to see.
        sink.delay_s = 0.03
        now = time.time_ns() // 1_000_000
        engine.schedule([Message("T", b"x", now + 200, msg_id=f"b{i}") for i in range(10_000)])
        assert wait_for(lambda: len(sink.ids) == 12_000, 30)
    assert sorted(sink.ids) == sorted([f"t{i}" for i in range(2000)] + [f"b{i}" for i in range(10_000)])
    print(f"\ntrickle: {trickle_sends} sends, {trickle_beside} beside another; burst: most in flight "
          f"{sink.most_in_flight}")
    # Only a send that outlasts the bounded wait (20 ms; a stall of this machine) has company.
    # Before small batches waited, nearly every send of the trickle started beside another, and
    # there were 2-4 times as many sends (336-740 for these 2,000 messages).
    assert trickle_beside <= trickle_sends // 20, "small batches wait for the send in flight"
    assert trickle_sends <= 2000 / 5, "a send carries what came due during the one before"
    assert sink.most_in_flight > 1, "full batches go side by side"


def test_a_slow_send_holds_small_batches_back_only_briefly(tmp_path: Path) -> None:
    # A broker timing out (here: 1 s a send) must not hold every other due message for that long.
    sink = RoundTripSink(2)
    sink.delay_s = 1.0
    with Engine(EngineConfig(data_dir=tmp_path / "data"), sink) as engine:
        now = time.time_ns() // 1_000_000
        engine.schedule([Message("T", b"x", now + 200 + i * 50, msg_id=f"s{i}") for i in range(10)])
        assert wait_for(lambda: len(sink.ids) == 10, 30)
    print(f"\nslow sends: {len(sink.sizes)} sends, most in flight {sink.most_in_flight}")
    assert sink.most_in_flight > 1, "small batches went beside the slow send after a bounded wait"


def test_a_send_does_not_wait_for_the_timer_and_its_outcomes_reach_the_timer_later(
        make_engine: Callable[..., Engine], clock: ManualClock, sink: RecordingSink) -> None:
    e = make_engine()
    e.schedule([Message("T", b"x", T0 + 10, msg_id=f"m{i}") for i in range(3)])
    clock.set(T0 + 10)
    run = e._run
    assert run is not None
    run.timer.run_pass(clock.now_ms())
    seg = next(iter(run.timer.loader.loaded))
    assert run.timer.loader.loaded[seg].outstanding == 3
    done = threading.Event()
    with run.timer._lock:  # as while the timer loads a segment
        def dispatch_pass() -> None:
            run.dispatcher.dispatch_pass()
            done.set()

        t = threading.Thread(target=dispatch_pass)
        t.start()
        assert done.wait(10), "a dispatch pass waited for the timer's lock"
    t.join()
    assert sorted(m for m, _ in sink.sent) == ["m0", "m1", "m2"]
    assert run.timer.loader.loaded[seg].outstanding == 3, "the timer counts outcomes off on its own thread"
    run.timer.run_pass(clock.now_ms())
    assert run.timer.loader.loaded[seg].outstanding == 0


def test_the_timer_pops_in_steps_of_the_sinks_linger(make_engine: Callable[..., Engine], clock: ManualClock,
                                                     sink: RecordingSink) -> None:
    sink.linger_ms = 5  # type: ignore[attr-defined]
    e = make_engine()
    e.schedule([Message("T", b"x", T0 + 100 + i, msg_id=f"m{i}") for i in range(4)])
    e.step()
    assert e.next_wakeup_ms() == T0 + 105, "a linger after the first was due, with what came due meanwhile"
    clock.set(T0 + 105)
    assert e.step() == 4 and [t for _, t in sink.sent] == [T0 + 105] * 4


class ThreadNamingSink:
    """Answers at once; records which thread sent each message."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent: list[tuple[str, str]] = []  # (msg_id, thread name)

    def send_batch(self, messages: Sequence[Message]) -> list[bool]:
        name = threading.current_thread().name
        with self.lock:
            self.sent += [(m.msg_id or "", name) for m in messages]
        return [True] * len(messages)


def test_a_trickle_is_sent_on_the_timers_thread_each_message_once(tmp_path: Path) -> None:
    sink = ThreadNamingSink()
    with Engine(EngineConfig(data_dir=tmp_path / "data"), sink) as engine:
        now = time.time_ns() // 1_000_000
        engine.schedule([Message("T", b"x", now + 300 + i * 5, msg_id=f"t{i}") for i in range(100)])
        assert wait_for(lambda: len(sink.sent) == 100, 30)
        run = engine._run
        assert run is not None
        inline = run.dispatcher.counts().timer_thread_passes
        assert engine.stats().counters.timer_thread_passes == inline
        from timewheel.app.metrics import EngineCollector
        exported = {s.name: s.value for m in EngineCollector(engine.stats, lambda: engine.lateness_buckets).collect()
                    for s in m.samples}
        assert exported["timewheel_timer_thread_passes_total"] == inline
    assert sorted(m for m, _ in sink.sent) == sorted(f"t{i}" for i in range(100))
    on_timer = sum(t == "timewheel-timer" for _, t in sink.sent)
    print(f"\n{on_timer} of 100 sent on the timer's thread, in {inline} passes")
    # Not all: a dispatch thread that wakes from its longest wait (50 ms) may find one first, and a
    # stall of this machine over 20 ms leaves the sends to the dispatch threads for a while.
    assert on_timer and inline, "what the timer popped at a low rate went on its own thread"


class _RuleInForce:
    """A shaper with a rule: nothing passes through."""

    def passes_through(self) -> bool:
        return False

    def next_grant_ms(self, now_ms: int) -> int | None:
        return None


def test_a_slow_send_leaves_the_sends_to_the_dispatch_threads_until_they_are_fast_again(
        make_engine: Callable[..., Engine], clock: ManualClock, sink: RecordingSink) -> None:
    e = make_engine()
    run = e._run
    assert run is not None
    e.schedule([Message("T", b"x", T0 + 10 + i, msg_id=f"m{i}") for i in range(3)])
    clock.set(T0 + 10)
    run.timer.run_pass(clock.now_ms())
    answer = sink.send_batch

    def slow(messages: Sequence[Message]) -> list[bool]:
        clock.advance(30)  # a broker that took 30 ms to answer
        return answer(messages)

    sink.send_batch = slow  # type: ignore[method-assign]
    assert run.dispatcher.send_if_idle()
    sink.send_batch = answer  # type: ignore[method-assign]
    run.timer.run_pass(clock.now_ms())
    assert not run.dispatcher.send_if_idle(), "after a slow send the dispatch threads send alone"
    clock.set(T0 + 10 + 30 + 10 * 30)  # 10 times as long as the slow send went by
    assert not run.dispatcher.send_if_idle(), "and stay alone until their sends are fast again"
    for _ in range(50):
        run.dispatcher._timed(clock.now_ms(), 0)  # a dispatch thread's pass that found nothing to send
    assert not run.dispatcher.send_if_idle(), "passes that sent nothing say nothing of the broker"
    for _ in range(19):
        run.dispatcher._timed(clock.now_ms(), 1)  # a dispatch thread's fast send
    assert not run.dispatcher.send_if_idle()
    run.dispatcher._timed(clock.now_ms(), 1)
    assert run.dispatcher.send_if_idle(), "20 fast passes in a row: the timer sends again"
    assert [m for m, _ in sink.sent] == ["m0", "m1", "m2"]
    assert not run.dispatcher.send_if_idle(), "nothing left"
    run.dispatcher.shaper = _RuleInForce()  # type: ignore[assignment]
    e.schedule([Message("T", b"x", clock.now_ms(), msg_id="r")])
    run.timer.run_pass(clock.now_ms())
    assert not run.dispatcher.send_if_idle(), "a shaper rule in force: its grants are the dispatch threads' to wait for"
