"""bench.cold_cache: a send step's CPU with the caches warm or evicted, stages left out on request."""
from __future__ import annotations

import pytest

from bench.cold_cache import WITHOUT, steps


@pytest.mark.parametrize("without", [(), *[(name,) for name in sorted(WITHOUT)]])
def test_a_step_sends_one_message_whatever_stage_is_left_out(without: tuple[str, ...]) -> None:
    # steps() raises unless every step sent its one message: a stage left out must not stop the sends
    timer, dispatch = steps(0, 30, without)
    assert timer > 0 and dispatch > 0


def test_a_stage_left_out_is_left_out_only_for_the_run() -> None:
    cls, method = WITHOUT["outcomes"]
    before = getattr(cls, method)
    calls: list[object] = []
    steps(0, 5, ("outcomes",))
    assert getattr(cls, method) is before, "the stage is back once the run is over"
    cls_l, method_l = WITHOUT["lateness"]
    original = getattr(cls_l, method_l)

    def counting(self: object, *a: object, **k: object) -> None:
        calls.append(a)
        return original(self, *a, **k)

    setattr(cls_l, method_l, counting)
    try:
        steps(0, 5, ("lateness",))
        assert calls == [], "left out: never called"
        steps(0, 5)
        assert calls, "not left out: called each step"
    finally:
        setattr(cls_l, method_l, original)
