"""The nemesis checker's fencing rule, on made-up rounds (no broker): what a deposed epoch may store late."""
from __future__ import annotations

from tests.coordination.cluster import Delivery, Sent
from tests.coordination.nemesis import Round, check


def _failures(fault: str, store_ms: list[int]) -> tuple[list[str], list[str]]:
    rnd = Round(1, fault, start_ms=0, end_ms=5000, fenced=[(2, 1000)])
    bodies = [f"m{k}".encode() for k in range(len(store_ms))]
    sent = {b: Sent(0, 100, b.decode()) for b in bodies}
    copies = {b: [Delivery(2, ms)] for b, ms in zip(bodies, store_ms)}
    return check([rnd], sent, copies, {2: ("r0", 0)}, 0).failures, rnd.notes


def test_a_paused_holder_may_store_the_one_batch_in_flight_and_the_round_says_so() -> None:
    failures, notes = _failures("pause", [1500, 1500])
    assert not [f for f in failures if "deposed" in f]
    assert "2 stored late in the batch in flight at the pause" in notes


def test_a_paused_holder_storing_two_batches_late_fails() -> None:
    failures, _ = _failures("pause", [1500, 1600])
    assert "round 1 (pause): 2 copies with the deposed epoch 2 stored after its deadline, in 2 batches" in failures


def test_a_cut_off_holder_may_store_nothing_late() -> None:
    failures, _ = _failures("partition", [1500])
    assert "round 1 (partition): 1 copies with the deposed epoch 2 stored after its deadline, in 1 batches" in failures
