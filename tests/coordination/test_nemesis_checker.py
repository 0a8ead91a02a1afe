"""The nemesis checker's fencing rule, on made-up rounds (no broker): what a deposed epoch may store late.

A late copy is given as (store time, broker, queue id, queue offset): where the broker stored it.
"""
from __future__ import annotations

from tests.coordination.cluster import Delivery, Sent, at_most_one_send_batch
from tests.coordination.nemesis import ERA, Failover, Round, check

Stored = tuple[int, str, int, int]


def _failures(fault: str, stored: list[Stored], *, received_twice: bool = False) -> tuple[list[str], list[str]]:
    rnd = Round(1, fault, start_ms=0, end_ms=5000, fenced=[(2, 1000)])
    bodies = [f"m{k}".encode() for k in range(len(stored))]
    sent = {b: Sent(0, 100, b.decode()) for b in bodies}
    copies = {b: [Delivery(2, *where)] * (2 if received_twice else 1) for b, where in zip(bodies, stored)}
    return check([rnd], sent, copies, {2: ("r0", 0)}, 0).failures, rnd.notes


def _deposed(failures: list[str]) -> list[str]:
    return [f for f in failures if "deposed" in f]


def test_a_paused_holder_may_store_the_one_batch_in_flight_and_the_round_says_so() -> None:
    failures, notes = _failures("pause", [(1500, "broker-a", 1, 7), (1500, "broker-a", 1, 8), (1500, "broker-a", 1, 9)])
    assert not _deposed(failures)
    assert "3 stored late in the batch in flight at the pause" in notes


def test_a_batch_the_consumer_received_twice_is_still_one_batch() -> None:
    failures, notes = _failures("pause", [(1500, "broker-a", 1, 7), (1500, "broker-a", 1, 8)], received_twice=True)
    assert not _deposed(failures)
    assert "4 stored late in the batch in flight at the pause" in notes


def test_a_paused_holder_storing_two_batches_late_fails() -> None:
    failures, _ = _failures("pause", [(1500, "broker-a", 1, 7), (1600, "broker-a", 1, 8)])
    assert _deposed(failures) == ["round 1 (pause): 2 copies with the deposed epoch 2 stored after its deadline, "
                                  "more than one send batch (at 1500 on broker-a:1 offsets 7; "
                                  "at 1600 on broker-a:1 offsets 8)"]


def test_two_batches_stored_in_the_same_millisecond_on_two_queues_fail() -> None:
    failures, notes = _failures("pause", [(1500, "broker-a", 1, 7), (1500, "broker-a", 2, 7)])
    assert _deposed(failures) == ["round 1 (pause): 2 copies with the deposed epoch 2 stored after its deadline, "
                                  "more than one send batch (at 1500 on broker-a:1 offsets 7; "
                                  "at 1500 on broker-a:2 offsets 7)"]
    assert not notes


def test_two_batches_stored_in_the_same_millisecond_on_one_queue_with_a_gap_fail() -> None:
    failures, _ = _failures("pause", [(1500, "broker-a", 1, 7), (1500, "broker-a", 1, 8), (1500, "broker-a", 1, 10)])
    assert _deposed(failures) == ["round 1 (pause): 3 copies with the deposed epoch 2 stored after its deadline, "
                                  "more than one send batch (at 1500 on broker-a:1 offsets 7,8,10)"]


def test_two_batches_stored_in_the_same_millisecond_on_two_brokers_fail() -> None:
    failures, _ = _failures("pause", [(1500, "broker-a", 1, 7), (1500, "broker-b", 1, 8)])
    assert len(_deposed(failures)) == 1


def test_a_cut_off_holder_may_store_nothing_late() -> None:
    failures, _ = _failures("partition", [(1500, "broker-a", 1, 7)])
    assert _deposed(failures) == ["round 1 (partition): 1 copies with the deposed epoch 2 stored after its deadline "
                                  "(at 1500 on broker-a:1 offsets 7)"]


def test_no_copies_are_not_a_batch_too_many() -> None:
    assert at_most_one_send_batch([])


def _resent(copies: dict[bytes, list[Delivery]], produced: dict[bytes, int] | None = None) -> dict[str, int]:
    rnd = Round(1, "broker", start_ms=0, end_ms=5000)
    sent = {b: Sent(0, 100, b.decode()) for b in copies}
    if produced is None:
        return check([rnd], sent, copies, {2: ("r0", 0)}, 0).totals
    return check([rnd], sent, copies, {2: ("r0", 0)}, 0, produced=produced).totals


def test_a_body_the_producer_stored_under_two_ids_is_two_messages_not_a_resend() -> None:
    # A send the producer saw fail (a broker killed or starting under load) may have been stored: the
    # workload sends the body again under a new id, and the holder delivers each delay message once.
    copies = {b"twice": [Delivery(2, 1500, "", 1, 7), Delivery(2, 9500, "", 2, 3)],
              b"once": [Delivery(2, 1500, "", 1, 8), Delivery(2, 1600, "", 3, 4)]}
    totals = _resent(copies, produced={b"twice": 2, b"once": 1, b"TW_CANCEL_ID=x": 4})
    assert totals["resent"] == 1  # "once" only: one delay message, two stored copies
    assert totals["resent_by_producer"] == 1  # a cancel on every queue is not the workload's body


def test_a_copy_the_consumer_received_twice_is_one_stored_copy_not_a_resend() -> None:
    totals = _resent({b"m0": [Delivery(2, 1500, "", 1, 7)] * 2})
    assert totals["resent"] == 0


def test_a_copy_stored_while_no_replica_could_confirm_a_lease_fails() -> None:
    # ZooKeeper down: from the holder's fencing deadline until it is back, nothing may be stored
    rnd = Round(1, "zookeeper_restart", start_ms=0, end_ms=9000, silent=[(1000, 7000)])
    sent = {b"m0": Sent(0, 100, "m0"), b"m1": Sent(0, 100, "m1")}
    copies = {b"m0": [Delivery(2, 900, "broker-a", 1, 7)], b"m1": [Delivery(2, 1500, "broker-a", 1, 8)]}
    failures = check([rnd], sent, copies, {2: ("r0", 0)}, 0).failures
    assert failures == ["round 1 (zookeeper_restart): 1 copies stored while no replica could confirm a lease "
                        "(at 1500 on broker-a:1 offsets 8)"]


def test_epochs_counted_from_1_again_after_zookeeper_came_back_empty_are_told_from_the_old_ones() -> None:
    # the old holder (epoch 2) was paused, then ZooKeeper came back empty at 5000 and a new holder
    # took epoch 2 of the new count: its copies are not the paused holder's, but a copy the old epoch 2
    # stored late still fails, and a message the new holder sent again counts at that failover
    pause = Round(1, "pause", start_ms=0, end_ms=4000, fenced=[(2, 1000)])
    failover = Failover(4000, 9000, 3, ERA + 2, healed_ms=5000, limit_s=90)
    wipe = Round(2, "zookeeper_wipe", start_ms=4000, end_ms=20000, epoch_reset_ms=5000, failovers=[failover])
    sent = {b"new": Sent(0, 6000, "new"), b"late": Sent(0, 100, "late"), b"twice": Sent(0, 3900, "twice"),
            b"lost": Sent(0, 6500, "lost")}
    copies = {b"new": [Delivery(2, 9500, "broker-a", 1, 20)], b"late": [Delivery(2, 1500, "broker-a", 2, 7)],
              b"late2": [Delivery(2, 1600, "broker-a", 3, 7)],
              b"twice": [Delivery(3, 3950, "broker-a", 1, 9), Delivery(2, 9400, "broker-a", 1, 19)]}
    sent[b"late2"] = Sent(0, 100, "late2")
    report = check([pause, wipe], sent, copies, {2: ("r0", 0), 3: ("r1", 2000), ERA + 2: ("r0", 9000)}, 0)
    assert _deposed(report.failures) == ["round 1 (pause): 2 copies with the deposed epoch 2 stored after its "
                                         "deadline, more than one send batch (at 1500 on broker-a:2 offsets 7; "
                                         "at 1600 on broker-a:3 offsets 7)"]
    assert failover.dups == 1
    assert "round 2 (zookeeper_wipe): 1 acknowledged messages never delivered" in report.failures
