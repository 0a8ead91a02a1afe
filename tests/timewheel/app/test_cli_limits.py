"""`timewheel send`, `cancel`, `status` and `find` at each input limit and one past it: the right
result, or one clear line saying what is wrong and what to do (exit 2), never a traceback or a
message the engine would dead-letter."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import pytest
from prometheus_client import CollectorRegistry
from typer.testing import CliRunner, Result

import forwarder._rmq_native as native
from forwarder.contract import DELIVERY_PROPERTIES_BUDGET, DUE_MS, ORIGINAL_MSG_ID, properties_size
from forwarder.rocketmq.message import OutgoingMessage, SendResult, SendStatus
from storage import TWO_YEARS_MS
from timewheel import Engine, EngineConfig, Message
from timewheel.app.admin import AdminServer
from timewheel.app.cli import app
from timewheel.cancels import CancelRequest
from timewheel.config import DEFAULT_MAX_BODY_BYTES
from timewheel.find import MAX_LIMIT

NOT_UTF8 = b"order-\xff".decode("utf-8", "surrogateescape")  # what Python makes of such bytes in argv


class _Producer:
    """Stands in for the native producer: keeps what would have been sent."""

    sent: list[OutgoingMessage] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def start(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def send(self, msg: OutgoingMessage) -> SendResult:
        _Producer.sent.append(msg)
        return SendResult(SendStatus.OK, "0A0B0C0D" * 4, 0)


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[OutgoingMessage]]:
    """What `timewheel send` handed to the producer."""
    monkeypatch.setattr(native, "NativeProducer", _Producer)
    _Producer.sent = []
    yield _Producer.sent


def _send(*args: str) -> Result:
    argv = ["send", "--namesrv", "127.0.0.1:9876", *args]
    if "--body" not in argv:
        argv += ["--body", "hello"]
    if "--topic" not in argv:
        argv += ["--topic", "ORDERS"]
    return CliRunner().invoke(app, argv)


def _refused(res: Result, *words: str) -> None:
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    # one line of ours, or click's usage error for an option it could not parse
    assert (len(lines) == 1 and lines[0].startswith("timewheel: ")) or lines[-1].startswith("Error: "), res.output
    for w in words:
        assert w in res.output, res.output


def _accepted(res: Result, sent: list[OutgoingMessage]) -> OutgoingMessage:
    assert res.exit_code == 0, res.output
    assert res.exception is None, repr(res.exception)
    assert len(sent) == 1
    return sent[0]


# ---- send: body ---------------------------------------------------------------------------------

def test_a_body_at_the_engines_maximum_is_sent_and_one_byte_more_is_refused(sent: list[OutgoingMessage]) -> None:
    _accepted(_send("--delay", "1s", "--body", "x" * DEFAULT_MAX_BODY_BYTES), sent)
    _refused(_send("--delay", "1s", "--body", "x" * (DEFAULT_MAX_BODY_BYTES + 1)), "body", "maximum")
    assert len(sent) == 1


def test_a_body_that_is_not_utf8_is_refused_without_a_traceback(sent: list[OutgoingMessage]) -> None:
    _refused(_send("--delay", "1s", "--body", NOT_UTF8), "--body", "UTF-8")
    assert not sent


# ---- send: delay and due time -------------------------------------------------------------------

def test_a_delay_at_the_maximum_is_sent_and_one_ms_more_is_refused(sent: list[OutgoingMessage]) -> None:
    m = _accepted(_send("--delay", str(TWO_YEARS_MS)), sent)
    assert m.properties["TW_DELAY_MS"] == str(TWO_YEARS_MS)
    _refused(_send("--delay", str(TWO_YEARS_MS + 1)), "maximum delay")
    _refused(_send("--delay", "1000d"), "maximum delay")
    assert len(sent) == 1


@pytest.mark.parametrize("delay", ["9" * 30, "1" + "0" * 400 + "d", "1e3"])
def test_an_absurd_delay_is_refused_in_one_line(sent: list[OutgoingMessage], delay: str) -> None:
    _refused(_send("--delay", delay))
    assert not sent


def test_a_deliver_at_past_the_maximum_delay_is_refused(sent: list[OutgoingMessage]) -> None:
    now = int(time.time() * 1000)
    _refused(_send("--at", str(now + TWO_YEARS_MS + 60_000)), "maximum delay")
    _refused(_send("--at", "9" * 25))
    _refused(_send("--at", "9999-12-31T00:00:00Z"), "maximum delay")
    _refused(_send("--at", "0001-01-01T00:00:00Z"), "negative")
    assert not sent


def test_a_deliver_at_in_the_past_is_sent_and_the_user_is_told_it_is_delivered_at_once(
        sent: list[OutgoingMessage]) -> None:
    now = int(time.time() * 1000)
    res = _send("--at", str(now - 3_600_000))
    m = _accepted(res, sent)
    assert m.properties["TW_DELIVER_AT_MS"] == str(now - 3_600_000)
    assert "in the past" in res.output and "at once" in res.output, res.output


def test_a_deliver_at_in_epoch_seconds_is_refused_saying_so(sent: list[OutgoingMessage]) -> None:
    seconds = int(time.time()) + 60
    _refused(_send("--at", str(seconds)), "seconds", f"{seconds}000")
    assert not sent


def test_a_deliver_at_in_full_width_digits_is_not_read_as_a_time(sent: list[OutgoingMessage]) -> None:
    _refused(_send("--at", "１２３４５６７８９０１２３"))
    assert not sent


# ---- send: topics -------------------------------------------------------------------------------

@pytest.mark.parametrize("topic,words", [
    ("RMQ_SYS_TRANS_HALF_TOPIC", ["system topic"]), ("%RETRY%group", ["topic"]), ("TBW102", ["system topic"]),
    ("SCHEDULE_TOPIC_XXXX", ["system topic"]), ("TW_DELAY", ["engine's own"]), ("TW_DLQ", ["engine's own"]),
    ("", ["not a valid topic"]), ("  ", ["not a valid topic"]), ("T" * 128, ["at most 127"]),
    ("a.b", ["not a valid topic"])])
def test_a_target_the_engine_would_dead_letter_is_refused(sent: list[OutgoingMessage], topic: str,
                                                          words: list[str]) -> None:
    _refused(_send("--topic", topic, "--delay", "1s"), *words)
    assert not sent


def test_the_delay_topic_given_is_not_a_target_either(sent: list[OutgoingMessage]) -> None:
    _refused(_send("--topic", "MY_DELAY", "--delay-topic", "MY_DELAY", "--delay", "1s"), "engine's own")
    _refused(_send("--topic", "ORDERS", "--delay-topic", "", "--delay", "1s"), "delay")
    assert not sent


def test_a_target_of_127_characters_is_sent(sent: list[OutgoingMessage]) -> None:
    _accepted(_send("--topic", "T" * 127, "--delay", "1s"), sent)


# ---- send: keys, tags -----------------------------------------------------------------------------

def _largest_keys() -> int:
    """The longest keys a delivered copy can carry beside the engine's id and due time."""
    fixed = {ORIGINAL_MSG_ID: "0" * 32 + ":" + "0" * 8, DUE_MS: str(int(time.time() * 1000))}
    n = DELIVERY_PROPERTIES_BUDGET
    while properties_size(fixed, None, "k" * n) > DELIVERY_PROPERTIES_BUDGET:
        n -= 1
    return n


@pytest.mark.parametrize("option", ["--keys", "--tags"])
def test_keys_and_tags_at_the_properties_limit_are_sent_and_one_byte_more_is_refused(
        sent: list[OutgoingMessage], option: str) -> None:
    n = _largest_keys()
    _accepted(_send("--delay", "1s", option, "k" * n), sent)
    _refused(_send("--delay", "1s", option, "k" * (n + 1)), "properties", str(DELIVERY_PROPERTIES_BUDGET))
    _refused(_send("--delay", "1s", option, "k" * 40_000), "properties")
    assert len(sent) == 1


def test_the_message_on_the_delay_topic_fits_too_with_the_longest_target(sent: list[OutgoingMessage]) -> None:
    # the delay message carries the target's name and due time, which the delivered copy does not
    at = str(int(time.time() * 1000) + 60_000)
    props = {"TW_TARGET_TOPIC": "T" * 127, "TW_DELIVER_AT_MS": at}
    n = _largest_keys()
    while properties_size(props, None, "k" * n) > DELIVERY_PROPERTIES_BUDGET:
        n -= 1
    _refused(_send("--topic", "T" * 127, "--at", at, "--keys", "k" * (n + 1)), "properties", "--keys")
    m = _accepted(_send("--topic", "T" * 127, "--at", at, "--keys", "k" * n), sent)
    assert properties_size(m.properties, m.tags, m.keys) <= DELIVERY_PROPERTIES_BUDGET


@pytest.mark.parametrize("option,value,words", [
    ("--keys", "a\x01b", ["control character"]), ("--tags", "a\x02b", ["control character"]),
    ("--keys", NOT_UTF8, ["--keys", "UTF-8"]), ("--tags", NOT_UTF8, ["--tags", "UTF-8"]),
    ("--topic", NOT_UTF8, ["--topic", "UTF-8"])])
def test_keys_and_tags_no_message_can_carry_are_refused(sent: list[OutgoingMessage], option: str, value: str,
                                                        words: list[str]) -> None:
    _refused(_send("--delay", "1s", option, value), *words)
    assert not sent


# ---- cancel ---------------------------------------------------------------------------------------

class _Target:
    def __init__(self) -> None:
        self.asked: list[tuple[str | None, str | None]] = []

    def cancel(self, msg_id: str | None, key: str | None) -> int:
        CancelRequest(msg_id, key, 0)  # the engine's rule
        self.asked.append((msg_id, key))
        return 1


@pytest.fixture
def admin() -> Iterator[tuple[str, _Target]]:
    """A loopback admin API over a target that applies the engine's rule to each cancel."""
    target = _Target()
    server = AdminServer("127.0.0.1:0", "tok", target, CollectorRegistry()).start()  # type: ignore[arg-type]
    try:
        yield server.address, target
    finally:
        server.stop()


def _cancel(address: str, *args: str) -> Result:
    return CliRunner().invoke(app, ["cancel", "--admin", address, "--token", "tok", *args])


@pytest.mark.parametrize("args", [[], ["--id", "A", "--key", "k"], ["--key", ""], ["--key", "   "], ["--id", ""],
                                  ["--key", "a b"], ["--key", "a\x01b"], ["--key", NOT_UTF8], ["--id", NOT_UTF8],
                                  ["--key", "k" * 65_536]])
def test_a_cancel_no_engine_could_apply_is_refused_in_one_line(admin: tuple[str, _Target], args: list[str]) -> None:
    address, target = admin
    _refused(_cancel(address, *args))
    assert not target.asked


def test_a_cancel_by_a_key_too_long_for_the_admin_api_says_how_to_send_it(admin: tuple[str, _Target]) -> None:
    address, target = admin
    res = _cancel(address, "--key", "k" * 20_000)
    _refused(res, "too long", "TW_CANCEL_KEY")
    assert "the engine refused" not in res.output


def test_a_cancel_by_a_long_key_within_the_admin_apis_limit_is_applied(admin: tuple[str, _Target]) -> None:
    address, target = admin
    res = _cancel(address, "--key", "k" * 10_000)
    assert res.exit_code == 0, res.output
    assert target.asked == [(None, "k" * 10_000)]


@pytest.mark.parametrize("address", ["no port here/x", "127.0.0.1:99999", "[::1"])
def test_a_cancel_to_a_malformed_admin_address_says_so(address: str) -> None:
    res = CliRunner().invoke(app, ["cancel", "--admin", address, "--key", "k"])
    _refused(res, "--admin")


# ---- status -------------------------------------------------------------------------------------

@pytest.mark.parametrize("address", ["127.0.0.1:abc", "a b:1", "127.0.0.1:93 21"])
def test_status_at_a_malformed_admin_address_says_so_in_one_line(address: str) -> None:
    """A typo in --admin is a usage error (2), not a traceback and not 1, which says "not serving"."""
    res = CliRunner().invoke(app, ["status", "--admin", address, "--json"])
    _refused(res, "--admin")


# ---- find ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A data directory holding MAX_LIMIT + 5 messages under one key, and the id of one of them."""

    class _Sink:
        def send_batch(self, messages: Sequence[Message]) -> list[bool]:
            return [True] * len(messages)

    d = tmp_path_factory.mktemp("data")
    due = int(time.time() * 1000) + 3_600_000
    with Engine(EngineConfig(data_dir=d), _Sink()) as engine:
        ids = engine.schedule([Message("ORDERS", b"x", due, None, ("shared",)) for _ in range(MAX_LIMIT + 5)])
    return d, ids[0]


def _find(d: Path, *args: str) -> Result:
    return CliRunner().invoke(app, ["find", "--data-dir", str(d), *args])


def test_find_an_id_that_is_not_there_or_is_malformed_answers_none(data_dir: tuple[Path, str]) -> None:
    d, msg_id = data_dir
    for what in ("7F0000010B1C18B4AAC2757D2E170043", msg_id + ":zzzz", "not an id\x01"):
        res = _find(d, "--id", what)
        assert res.exit_code == 1 and res.exception is None or isinstance(res.exception, SystemExit), res.output
        assert res.output.startswith("no stored message with id"), res.output
    assert _find(d, "--id", msg_id).exit_code == 0


@pytest.mark.parametrize("args,words", [(["--id", ""], ["--id"]), (["--key", " "], ["--key"]),
                                        (["--key", NOT_UTF8], ["--key", "UTF-8"]),
                                        (["--id", NOT_UTF8], ["--id", "UTF-8"])])
def test_find_refuses_what_names_no_message(data_dir: tuple[Path, str], args: list[str], words: list[str]) -> None:
    _refused(_find(data_dir[0], *args), *words)


def test_find_a_key_with_more_matches_than_the_most_it_shows_says_what_to_do(data_dir: tuple[Path, str]) -> None:
    d, _ = data_dir
    res = _find(d, "--key", "shared")
    assert res.exit_code == 0 and "(more not shown: raise --limit)" in res.output.splitlines()[0], res.output
    res = _find(d, "--key", "shared", "--limit", str(MAX_LIMIT))
    head = res.output.splitlines()[0]
    assert res.exit_code == 0 and head.startswith(f"{MAX_LIMIT} message(s)"), head
    assert "raise --limit" not in head and str(MAX_LIMIT) in head.split("(", 1)[1], head
    for limit in ("0", str(MAX_LIMIT + 1)):
        assert _find(d, "--key", "shared", "--limit", limit).exit_code == 2


def test_find_in_a_directory_no_engine_has_served_says_nothing_is_stored_yet(tmp_path: Path) -> None:
    d = tmp_path / "fresh"
    assert CliRunner().invoke(app, ["init", "--data-dir", str(d)]).exit_code == 0
    res = _find(d, "--id", "7F0000010B1C18B4AAC2757D2E170043")
    assert res.exit_code == 1 and res.exception is None or isinstance(res.exception, SystemExit), res.output
    assert res.output.startswith("no stored message with id") and "no engine has stored anything" in res.output, (
        res.output)
    res = _find(d, "--key", "order-1", "--json")
    assert res.exit_code == 1 and '"messages": []' in res.output, res.output


# ---- send: --body-file and --config -------------------------------------------------------------

def _send_file(*args: str, stdin: bytes | None = None) -> Result:
    return CliRunner().invoke(app, ["send", "--namesrv", "127.0.0.1:9876", "--topic", "ORDERS", "--delay", "1s",
                                    *args], input=stdin)


def test_a_body_file_of_any_bytes_up_to_the_maximum_is_sent_and_one_byte_more_is_refused(
        sent: list[OutgoingMessage], tmp_path: Path) -> None:
    """A shell argument holds at most 128 KiB and only text: a body of the engine's maximum, or of
    any bytes, comes from a file or standard input, and one byte past the maximum is refused."""
    binary = bytes(range(256)) * (DEFAULT_MAX_BODY_BYTES // 256)
    path = tmp_path / "body.bin"
    path.write_bytes(binary[:DEFAULT_MAX_BODY_BYTES])
    assert _accepted(_send_file("--body-file", str(path)), sent).body == binary[:DEFAULT_MAX_BODY_BYTES]
    path.write_bytes(binary[:DEFAULT_MAX_BODY_BYTES] + b"!")
    _refused(_send_file("--body-file", str(path)), "over the maximum of", str(DEFAULT_MAX_BODY_BYTES))
    assert len(sent) == 1
    sent.clear()
    assert _accepted(_send_file("--body-file", "-", stdin=b"\xff\x00 from a pipe"), sent).body == b"\xff\x00 from a pipe"


def test_a_body_file_that_cannot_be_read_or_a_body_given_twice_is_refused(sent: list[OutgoingMessage],
                                                                          tmp_path: Path) -> None:
    _refused(_send_file("--body-file", str(tmp_path / "missing")), "--body-file: cannot read", "missing")
    _refused(_send_file("--body-file", str(tmp_path)), "--body-file: cannot read")
    (tmp_path / "b").write_bytes(b"x")
    _refused(_send_file("--body-file", str(tmp_path / "b"), "--body", "y"), "exactly one of --body or --body-file")
    _refused(_send_file(), "exactly one of --body or --body-file")
    assert not sent


def test_send_judges_the_message_by_the_engines_config_when_given(sent: list[OutgoingMessage],
                                                                  tmp_path: Path) -> None:
    """`send` judged every message as an engine with default settings: one whose engine allows less
    was sent and dead-lettered there. With `--config` the engine's limits, delay topic and NameServer
    are used."""
    cfg = tmp_path / "engine.toml"
    cfg.write_text('[engine]\ndata_dir = "/nonexistent/never-read"\nmax_body_bytes = 100\nmax_delay_ms = 60000\n'
                   '[rocketmq]\nnamesrv = "127.0.0.1:19876"\ndelay_topic = "MY_DELAY"\n')
    base = ["send", "--topic", "ORDERS", "--config", str(cfg)]
    m = _accepted(CliRunner().invoke(app, [*base, "--delay", "1m", "--body", "x" * 100]), sent)
    assert m.topic == "MY_DELAY"
    _refused(CliRunner().invoke(app, [*base, "--delay", "1m", "--body", "x" * 101]), "maximum", str(cfg))
    _refused(CliRunner().invoke(app, [*base, "--delay", "61s", "--body", "x"]), "maximum delay", str(cfg))
    _refused(CliRunner().invoke(app, [*base, "--delay", "1s", "--body", "x", "--topic", "MY_DELAY"]), "engine's own")
    _refused(CliRunner().invoke(app, ["send", "--topic", "ORDERS", "--delay", "1s", "--body", "x"]), "--namesrv")
    bad = tmp_path / "bad.toml"
    bad.write_text("[engine]\nmax_body_bytes = 0\n")
    _refused(CliRunner().invoke(app, [*base[:3], "--config", str(bad), "--delay", "1s", "--body", "x"]), "--config")
    assert len(sent) == 1


@pytest.mark.parametrize(("args", "words"), [
    (("--delay", "soon"), ["--delay: 'soon' is not a delay"]), (("--delay", "-5s"), ["--delay:"]),
    (("--at", "tomorrow"), ["--at: 'tomorrow' is not ISO-8601"]), (("--at", "1700000000"), ["--at:", "1700000000000"])])
def test_a_delay_or_time_that_cannot_be_read_is_one_line_not_a_usage_block(sent: list[OutgoingMessage],
                                                                           args: tuple[str, str], words: list[str]) -> None:
    res = _send(*args)
    assert res.exit_code == 2 and res.output.strip().splitlines() == [res.output.strip()], res.output
    assert res.output.startswith("timewheel: ") and "Usage:" not in res.output, res.output
    for w in words:
        assert w in res.output, res.output
    assert not sent


@pytest.mark.parametrize("flags", [["--since", "0", "--until", "9999999999999999"],
                                   ["--since", "-5", "--until", "1000"],
                                   ["--since", "0", "--until", "10000-01-01T00:00:00Z"]])
def test_replay_refuses_a_time_no_report_can_show_before_anything_runs(tmp_path: Path, flags: list[str],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # a time past year 9999 used to run the whole job (sending, without --dry-run) and then fail printing it
    import timewheel.app.cli_spark as cli_spark

    def no_session(*args: object, **kwargs: object) -> None:
        raise AssertionError("a Spark session was started for a time the command refuses")

    monkeypatch.setattr(cli_spark, "_spark", no_session)
    data = tmp_path / "data"
    assert CliRunner().invoke(app, ["init", "--data-dir", str(data)]).exit_code == 0
    result = CliRunner().invoke(app, ["replay", "--data-dir", str(data), *flags, "--dry-run"])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert "--since" in result.output or "--until" in result.output, result.output
