"""The rule for a replica's failing ZooKeeper rounds, on a scripted clock: a blip within the session
timeout is only in the status; a run past it makes the service not ready; the next good round clears it."""
from __future__ import annotations

import pytest
from kazoo.exceptions import ConnectionLoss, NoAuthError

from coordination._failing_rounds import FailingRounds
from coordination.fencing import FencingDeadline
from timewheel.app.readiness import not_ready_why

PATH = "/timewheel/TW_DELAY/shard-0-of-1"


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def monotonic(self) -> float:
        return self.t

    def now_ms(self) -> int:
        return 1_800_000_000_000 + int(self.t * 1000)


class _Engine:
    def checkpoint_failure(self) -> str | None:
        return None


class _Replica:
    def __init__(self, rounds: FailingRounds) -> None:
        self.zookeeper_rounds = rounds


def _rounds(clock: _Clock, asked_s: float = 6.0, granted_s: float | None = None) -> FailingRounds:
    fence = FencingDeadline(asked_s, 0.6, clock.monotonic)
    if granted_s is not None:
        fence.set_session_timeout(granted_s)
    return FailingRounds("zk1:2181,zk2:2181", "a", PATH, fence, clock.now_ms, clock.monotonic)


def _failed_round(rounds: FailingRounds, why: BaseException | str) -> None:
    rounds.failed(why)
    rounds.end_round()


def test_a_blip_shorter_than_the_session_shows_in_status_only_and_the_next_good_round_clears_it() -> None:
    clock = _Clock()
    rounds = _rounds(clock)
    assert rounds.status() == {"zookeeper_failing_since_ms": None, "zookeeper_failed_rounds": 0,
                               "zookeeper_last_error": None}
    _failed_round(rounds, ConnectionLoss())
    since = clock.now_ms()
    clock.t += 6.0  # exactly the session timeout: the session may still live, readiness does not move
    _failed_round(rounds, "not connected to ZooKeeper (its client keeps reconnecting)")
    assert rounds.status() == {"zookeeper_failing_since_ms": since, "zookeeper_failed_rounds": 2,
                               "zookeeper_last_error": "not connected to ZooKeeper (its client keeps reconnecting)"}
    assert rounds.not_ready_why() == []
    assert not_ready_why(_Engine(), True, [], {}, _Replica(rounds)) == []
    rounds.end_round()  # a round that did not fail
    assert rounds.status()["zookeeper_failed_rounds"] == 0 and rounds.not_ready_why() == []


def test_a_refusal_past_the_granted_session_names_the_shard_the_error_how_long_and_the_acl_to_check() -> None:
    clock = _Clock()
    rounds = _rounds(clock, asked_s=6.0, granted_s=4.0)  # measured against what ZooKeeper granted
    for _ in range(25):
        _failed_round(rounds, NoAuthError())
        clock.t += 0.2
    assert rounds.status()["zookeeper_last_error"] == "NoAuthError"
    [why] = not_ready_why(_Engine(), True, [], {}, _Replica(rounds))
    assert why.startswith(f"ZooKeeper at ha.zookeeper = 'zk1:2181,zk2:2181' has failed every round of replica 'a' "
                          f"of shard {PATH} for 5 s (25 rounds; the last: NoAuthError: a znode's ACL denies this "
                          f"client the request)"), why
    assert f"check the ACLs of {PATH} and the znodes under it (getAcl in zkCli.sh)" in why, why
    assert why.endswith("It is ready again at the first round that succeeds"), why
    rounds.end_round()
    assert rounds.not_ready_why() == [] and rounds.status()["zookeeper_last_error"] is None


def test_a_failure_that_is_no_refusal_says_to_check_that_zookeeper_is_up_and_reachable() -> None:
    clock = _Clock()
    rounds = _rounds(clock, asked_s=2.0)
    _failed_round(rounds, ConnectionLoss())
    clock.t += 2.5
    _failed_round(rounds, "not connected to ZooKeeper (its client keeps reconnecting)")
    [why] = rounds.not_ready_why()
    assert "for 2 s (2 rounds; the last: not connected to ZooKeeper (its client keeps reconnecting))" in why, why
    assert "check that it is up, reachable from this host and answering" in why and "ACL" not in why, why


def test_a_failure_line_in_status_is_one_line_and_cut() -> None:
    clock = _Clock()
    rounds = _rounds(clock)
    _failed_round(rounds, OSError("broken\n   pipe " + "x" * 999))
    last = rounds.status()["zookeeper_last_error"]
    assert isinstance(last, str) and last.startswith("OSError: broken pipe x") and "\n" not in last
    assert len(last) == 300 and last.endswith("…")


def test_a_lasting_failure_logs_its_traceback_once_then_when_it_changes_or_a_minute_went_by(
        caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from coordination._failing_rounds import REPEAT_S

    clock = _Clock()
    rounds = _rounds(clock)

    def logged() -> list[logging.LogRecord]:
        out = [r for r in caplog.records if "ZooKeeper request failed" in r.getMessage()]
        caplog.clear()
        return out

    with caplog.at_level(logging.WARNING, logger="timewheel.replica"):
        for _ in range(30):  # an ACL refusing the watermark fails every round
            _failed_round(rounds, NoAuthError())
            clock.t += 1.0
        first = logged()
        assert len(first) == 1 and first[0].exc_info is not None, "the first with its traceback, then nothing"
        _failed_round(rounds, ConnectionLoss())  # another error: at once
        [changed] = logged()
        assert "31 rounds in a row" in changed.getMessage()
        clock.t += REPEAT_S - 1
        _failed_round(rounds, ConnectionLoss())
        assert logged() == []
        clock.t += 1
        _failed_round(rounds, ConnectionLoss())
        [again] = logged()
        assert "33 rounds in a row" in again.getMessage() and again.exc_info is not None
        _failed_round(rounds, "not connected to ZooKeeper (its client keeps reconnecting)")
        assert logged() == [], "no request made: nothing to log here"
        assert rounds.status()["zookeeper_failed_rounds"] == 34, "every round counted, logged or not"
        rounds.end_round()  # a good round ends the run
        _failed_round(rounds, ConnectionLoss())
        [new_run] = logged()
        assert "rounds in a row" not in new_run.getMessage(), "a new run logs its first failure at once"


def test_the_lease_taken_and_lost_each_round_of_a_failing_run_is_logged_quietly_while_the_run_is() -> None:
    import logging

    from coordination._failing_rounds import REPEAT_S

    clock = _Clock()
    rounds = _rounds(clock)
    assert rounds.transition_level() == logging.WARNING, "no failure: every take-over and loss is a warning"
    # a holder whose watermark write is refused: each round takes the lease, fails, loses it
    _failed_round(rounds, NoAuthError())
    assert rounds.transition_level() == logging.WARNING, "the loss at the run's start is told"
    assert rounds.transition_level() == logging.WARNING, "and the first take-over in it"
    _failed_round(rounds, NoAuthError())
    levels = [rounds.transition_level() for _ in range(10)]  # five more rounds of take and lose
    assert levels == [logging.DEBUG] * 10, "from then on the run's own lines tell it"
    clock.t += REPEAT_S
    assert rounds.transition_level() == logging.WARNING, "a minute without a line about the run: told again"
    _failed_round(rounds, NoAuthError())  # logged again, with its count
    assert rounds.transition_level() == logging.DEBUG
    rounds.end_round()
    assert rounds.transition_level() == logging.WARNING, "the run over: told as ever"


def test_the_loss_and_the_take_over_around_a_zookeeper_outage_are_both_told() -> None:
    import logging

    clock = _Clock()
    rounds = _rounds(clock)
    _failed_round(rounds, ConnectionLoss())  # ZooKeeper goes away mid-round
    assert rounds.transition_level() == logging.WARNING, "the holder loses the lease"
    for _ in range(20):
        _failed_round(rounds, "not connected to ZooKeeper (its client keeps reconnecting)")
        clock.t += 1.0
    assert rounds.transition_level() == logging.WARNING, "back: it takes the lease again, in the run's last round"
