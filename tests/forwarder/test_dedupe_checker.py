"""The zero-duplicates checker's rules on made-up copies (no broker): where a duplicate and a loss are
counted, when a deposed holder's copy fails, and that a run without look-ups cannot pass."""
from __future__ import annotations

from tests.coordination.cluster import Sent
from tests.forwarder.dedupe_checker import RoundRecord, StoredCopy, check

COUNTS = {"found": 3, "missing": 2, "unknown": 0, "looked_up": 5, "episodes": 1}


def rounds() -> list[RoundRecord]:
    return [RoundRecord(1, "engine_kill", 1_000, dedupe=dict(COUNTS), resolve_ms_max=40),
            RoundRecord(2, "holder_kill", 2_000, dedupe=dict(COUNTS), resolve_ms_max=70)]


def copy(oid: str, body: bytes, store_ms: int, epoch: int = -1) -> StoredCopy:
    return StoredCopy(oid, oid, body, store_ms, epoch, "broker-a:0@0")


def test_every_message_once_passes() -> None:
    sent = {b"m1": Sent(900, 1_500, "A"), b"m2": Sent(1_900, 2_500, "B")}
    report = check(rounds(), sent, [copy("A:1", b"m1", 1_510), copy("B:1", b"m2", 2_510)])
    assert report.failures == []
    assert report.totals["acked"] == 2 and report.totals["found"] == 6 and report.totals["missing"] == 4
    assert report.totals["resolve_ms_max"] == 70
    assert "| all |" in report.table()


def test_a_duplicate_counts_in_the_round_its_second_copy_was_stored() -> None:
    sent = {b"m1": Sent(900, 1_500, "A")}
    report = check(rounds(), sent, [copy("A:1", b"m1", 2_100), copy("A:1", b"m1", 1_510)])
    assert [r["duplicates"] for r in report.rows] == [0, 1]
    assert [r["acked"] for r in report.rows] == [1, 0]
    assert any("round 2 (holder_kill): 1 duplicate" in f for f in report.failures)


def test_a_loss_counts_in_the_round_it_came_due() -> None:
    sent = {b"m1": Sent(900, 1_500, "A"), b"m2": Sent(1_900, 2_500, "B")}
    report = check(rounds(), sent, [copy("A:1", b"m1", 1_510)])
    assert [r["lost"] for r in report.rows] == [0, 1]
    assert report.totals["lost"] == 1


def test_a_copy_of_a_deposed_epoch_stored_after_its_deadline_fails() -> None:
    rs = rounds()
    rs[1].fenced.append((7, 2_400))
    sent = {b"m1": Sent(1_900, 2_300, "A"), b"m2": Sent(1_900, 2_450, "B")}
    ok = check(rs, sent, [copy("A:1", b"m1", 2_350, epoch=7), copy("B:1", b"m2", 2_460, epoch=8)])
    assert ok.failures == []
    late = check(rs, sent, [copy("A:1", b"m1", 2_350, epoch=7), copy("B:1", b"m2", 2_460, epoch=7)])
    assert late.totals["late_deposed_copies"] == 1 and any("deposed" in f for f in late.failures)


def test_without_counters_or_without_re_sends_it_cannot_pass() -> None:
    sent = {b"m1": Sent(900, 1_500, "A")}
    bare = [RoundRecord(1, "engine_kill", 1_000)]
    report = check(bare, sent, [copy("A:1", b"m1", 1_510)])
    assert any("vacuous" in f for f in report.failures)
    assert report.rows[0]["found"] is None and "| - |" in report.table()
    only_found = [RoundRecord(1, "engine_kill", 1_000, dedupe={**COUNTS, "missing": 0})]
    assert any("vacuous" in f for f in check(only_found, sent, [copy("A:1", b"m1", 1_510)]).failures)


def test_copies_without_an_id_or_that_no_producer_sent_fail() -> None:
    sent = {b"m1": Sent(900, 1_500, "A")}
    report = check(rounds(), sent, [copy("A:1", b"m1", 1_510), copy("", b"x", 1_520)])
    assert report.totals["without_original_id"] == 1 and report.totals["not_produced"] == 1
    assert any("no producer sent" in f for f in report.failures)


def test_a_body_under_two_ids_passes_only_if_the_producer_sent_it_twice() -> None:
    sent = {b"m1": Sent(900, 1_500, "A")}
    copies = [copy("A:1", b"m1", 1_510), copy("C:1", b"m1", 1_520)]
    assert any("more ids than" in f for f in check(rounds(), sent, copies).failures)
    twice = check(rounds(), sent, copies, produced={b"m1": 2})
    assert twice.failures == [] and twice.totals["resent_by_producer"] == 1


def test_a_message_stored_though_its_send_failed_is_no_stranger() -> None:
    sent = {b"m1": Sent(900, 1_500, "A")}
    copies = [copy("A:1", b"m1", 1_510), copy("B:1", b"m2", 1_520)]
    assert check(rounds(), sent, copies).totals["not_produced"] == 1
    assert check(rounds(), sent, copies, produced={b"m1": 1, b"m2": 1}).failures == []
