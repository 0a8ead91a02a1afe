"""`timewheel send` when no NameServer answers: a clear error that says what to check, in seconds; and
when one does, a body file's bytes on the delay topic as they were."""
from __future__ import annotations

import socket
import time
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from forwarder.local_rocketmq import LocalRocketMQ
from timewheel.app.cli import app
from tests.forwarder.target_reader import TargetReader
from tests.polling import wait_for


def test_a_send_without_a_name_server_fails_saying_what_to_check() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        namesrv = f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens there once closed
    start = time.monotonic()
    res = CliRunner().invoke(app, ["send", "--namesrv", namesrv, "--topic", "ORDERS", "--delay", "30s",
                                   "--body", "hello"])
    took = time.monotonic() - start
    assert res.exit_code == 2, res.output
    assert "timewheel: send failed: send to TW_DELAY failed (tried 4 times)" in res.output, res.output
    assert f"is a NameServer at {namesrv}" in res.output and "can this host reach them?" in res.output, res.output
    assert "sent " not in res.output
    assert took < 30, f"a send with nothing to send to took {took:.1f} s to fail"


@pytest.mark.rocketmq
def test_a_body_file_of_any_bytes_reaches_the_delay_topic_byte_for_byte(rocketmq: LocalRocketMQ,
                                                                        tmp_path: Path) -> None:
    """The success path against a real broker: what `send --body-file` put on the delay topic is the
    file's bytes (not text), with the target and the delay the engine reads."""
    run = uuid.uuid4().hex[:8]
    delay_topic = f"TW_DELAY_S{run}"
    rocketmq.create_topics([delay_topic], queues=1)
    body = bytes(range(256)) * 512 + b"\xff\xfe not UTF-8"  # 128 KiB and more: past what argv carries
    path = tmp_path / "body.bin"
    path.write_bytes(body)
    res = CliRunner().invoke(app, ["send", "--namesrv", rocketmq.namesrv_addr, "--topic", "ORDERS", "--delay", "5m",
                                   "--body-file", str(path), "--delay-topic", delay_topic, "--keys", f"k{run}"])
    assert res.exit_code == 0, res.output
    assert f"to {delay_topic} for ORDERS" in res.output
    with TargetReader(rocketmq.namesrv_addr, f"send-cli-{run}", delay_topic) as reader:
        assert wait_for(lambda: len(reader.messages()) >= 1, timeout=30)
        got = reader.messages()
    [m] = got
    assert m.body == body
    assert m.properties["TW_TARGET_TOPIC"] == "ORDERS" and m.properties["TW_DELAY_MS"] == "300000"
    assert m.keys == f"k{run}"
