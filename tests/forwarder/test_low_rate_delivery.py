"""At a low rate the engine sends what comes due on its timer's thread: through the real local
RocketMQ, with a traffic shaper without rules as `timewheel serve` runs, each message reaches a
consumer of its topic once, at its due time."""
from __future__ import annotations

import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from forwarder.config import RocketMQConfig
from forwarder.delivery import RocketMQSink
from forwarder.local_rocketmq import LocalRocketMQ
from forwarder.rocketmq import RemotingProducer
from forwarder.shaping import TrafficShaper
from tests.forwarder.target_reader import TargetReader
from tests.polling import wait_for
from timewheel import Engine, EngineConfig, Message

pytestmark = pytest.mark.rocketmq
N = 200


def test_a_trickle_goes_out_on_the_timers_thread_each_message_once(rocketmq: LocalRocketMQ, tmp_path: Path) -> None:
    run = uuid.uuid4().hex[:8]
    target = f"TW_TRICKLE_{run}"
    rocketmq.create_topics([target])
    cfg = RocketMQConfig(namesrv=rocketmq.namesrv_addr, producer_group=f"tw_trickle_{run}")
    with TargetReader(rocketmq.namesrv_addr, f"tw_trickle_reader_{run}", target) as reader:
        dead_letters = RemotingProducer(cfg.namesrv, cfg.producer_group)
        sink = RocketMQSink(cfg, dead_letters)
        try:
            with Engine(EngineConfig(tmp_path / "data"), sink, shaper=TrafficShaper()) as e:
                first = int(time.time() * 1000) + 1500
                e.schedule([Message(target, f"{run}-{i}".encode(), first + i * 5, msg_id=f"{run}-{i}")
                            for i in range(N)])
                assert wait_for(lambda: e.stats().counters.delivered == N, 60), e.stats().counters
                assert e._run is not None
                inline = e._run.dispatcher.counts().timer_thread_passes
                lateness = e.stats().lateness_ms
        finally:
            sink.close()
            dead_letters.close()
        assert wait_for(lambda: len(reader.messages()) >= N, 30), f"{len(reader.messages())} of {N} received"
        time.sleep(0.5)  # a copy sent twice would have arrived by now
        bodies = Counter(m.body.decode() for m in reader.messages())
    assert bodies == Counter(f"{run}-{i}" for i in range(N))
    print(f"\n{inline} passes on the timer's thread for {N} messages; lateness {lateness}")
    assert inline > 0, "a trickle of one message every 5 ms went on the timer's thread"
