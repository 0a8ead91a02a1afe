"""What a broker's message index keeps through a kill -9: messages sent `--age` seconds before the
kill and messages sent just before it, looked up by UNIQ_KEY once the broker is back.

    python -m bench.index_after_kill [--unsafe] [--file-bytes 65536] [--age 8] [--old 1500] [--recent 300]
                                     [--filler-rate 50]

The broker writes its checkpoint every 60 s: with --age past that and --filler-rate keeping it in
use, a crash recovery starts after the old messages, and only messageIndexSafe=true keeps them indexed.

One local RocketMQ broker (`forwarder.local_rocketmq`); `--unsafe` starts it with
messageIndexSafe=false, `--file-bytes` sets its commit-log file size (small files make the log roll
between the two sends). Prints one JSON line: how many of each set the index still finds.
"""
from __future__ import annotations

import argparse
import json
import time

from forwarder._rmq_native import LogLevel, NativeProducer
from forwarder.local_rocketmq import LocalRocketMQ
from forwarder.rocketmq import LookupState, MessageLookup, OutgoingMessage


def main(argv: list[str] | None = None) -> None:
    """Send, wait, send, kill the broker, start it, look every key up."""
    p = argparse.ArgumentParser(prog="python -m bench.index_after_kill", description=__doc__.split("\n\n")[0])
    p.add_argument("--unsafe", action="store_true", help="messageIndexSafe=false")
    p.add_argument("--file-bytes", type=int, default=0, help="mappedFileSizeCommitLog (0: the launcher's)")
    p.add_argument("--age", type=float, default=8.0, help="seconds between the old messages and the kill")
    p.add_argument("--old", type=int, default=1500)
    p.add_argument("--recent", type=int, default=300)
    p.add_argument("--filler-rate", type=float, default=0.0,
                   help="messages a second sent to another topic while waiting --age (a broker in use)")
    args = p.parse_args(argv)
    options: dict[str, str | int | bool] = {"messageIndexSafe": not args.unsafe}
    if args.file_bytes:
        options["mappedFileSizeCommitLog"] = args.file_bytes
    with LocalRocketMQ(stop_timeout=3.0, broker_options=options) as mq:
        mq.create_topics(["INDEX_AFTER_KILL", "INDEX_FILLER"], 4)
        producer = NativeProducer("index_after_kill", mq.namesrv_addr, log_level=LogLevel.ERROR)
        producer.start()
        begin = int(time.time() * 1000) - 5_000

        def send(n: int, tag: str) -> list[str]:
            return [producer.send(OutgoingMessage("INDEX_AFTER_KILL", f"{tag}{i}".encode() * 10, None, None,
                                                  {})).msg_id for i in range(n)]

        old = send(args.old, "old")
        until = time.monotonic() + args.age
        i = 0
        while time.monotonic() < until:
            if args.filler_rate > 0:
                producer.send(OutgoingMessage("INDEX_FILLER", b"f" * 1000, None, None, {}))
                i += 1
                time.sleep(1 / args.filler_rate)
            else:
                time.sleep(until - time.monotonic())
        recent = send(args.recent, "recent")
        time.sleep(0.5)
        producer.shutdown()
        mq.stop_broker(kill=True)
        mq.start_broker()
        time.sleep(2.0)
        lookup = MessageLookup(mq.namesrv_addr)
        end = int(time.time() * 1000) + 5_000
        found = {}
        for name, keys in (("old", old), ("recent", recent)):
            res = lookup.lookup("INDEX_AFTER_KILL", keys, begin, end)
            found[name] = sum(1 for k in keys if res[k].state == LookupState.FOUND)
        print(json.dumps({"messageIndexSafe": not args.unsafe, "file_bytes": args.file_bytes or None,
                          "age_s": args.age, "filler_rate": args.filler_rate, "old_found": found["old"], "old": len(old),
                          "recent_found": found["recent"], "recent": len(recent)}))


if __name__ == "__main__":
    main()
