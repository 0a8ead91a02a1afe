"""What a look-up on the target costs: µs per UNIQ_KEY looked up (QUERY_MESSAGE, pipelined) against a
local broker, for keys that are there (hit: one copy decoded and compared) and keys that are not
(miss: the broker answers QUERY_NOT_FOUND).

    python -m bench.lookup_cost [--messages 20000] [--batch 1 --batch 100 --batch 1000] [--rounds 5] [--namesrv H:P]

Without --namesrv, starts a local RocketMQ (`forwarder.local_rocketmq`, messageIndexSafe=true) for
the run. Sends --messages messages of 100 bytes to a fresh topic under derived ids
(`contract.delivered_id`), waits for the index to catch up, then per --batch size looks keys up in
batches through one `MessageLookup` (connections kept), --rounds passes over distinct keys: hits
drawn from the sent keys, misses random 32-hex-digit keys. Prints µs per key (median over the
rounds) and the wall time of one batch; bench/RESULTS_LOOKUP.md holds the figures of record.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
import uuid
from contextlib import ExitStack

from forwarder.contract import delivered_id
from forwarder.local_rocketmq import LocalRocketMQ
from forwarder.rocketmq import LookupState, MessageLookup, OutgoingMessage, RemotingProducer

_HEX = "0123456789ABCDEF"


def main() -> None:
    """Run the measurement and print a table."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--messages", type=int, default=20_000)
    ap.add_argument("--batch", type=int, action="append")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--namesrv")
    args = ap.parse_args()
    batches = args.batch or [1, 100, 1000]
    with ExitStack() as stack:
        if args.namesrv:
            namesrv = args.namesrv
            mq = None
        else:
            mq = stack.enter_context(LocalRocketMQ(stop_timeout=3.0))
            namesrv = mq.namesrv_addr
        topic = f"LOOKUP_BENCH_{uuid.uuid4().hex[:8]}"
        if mq is not None:
            mq.create_topics([topic])
        producer = stack.enter_context(RemotingProducer(namesrv, "tw_lookup_bench"))
        t0 = int(time.time() * 1000)
        keys = [delivered_id(f"{uuid.uuid4().hex.upper()}:{i:08x}", t0) for i in range(args.messages)]
        body = b"x" * 100
        for s in range(0, len(keys), 1000):
            chunk = keys[s:s + 1000]
            out = producer.send([OutgoingMessage(topic, body, None, None, {}) for _ in chunk], chunk)
            assert all(not isinstance(o, Exception) for o in out), out[0]
        time.sleep(1.0)  # indexing lags the send's answer by milliseconds
        begin, end = t0 - 2000, int(time.time() * 1000) + 60_000
        lookup = stack.enter_context(MessageLookup(namesrv))
        lookup.lookup(topic, keys[:10], begin, end)  # route and connection
        rng = random.Random(1)
        print(f"{args.messages} messages on one broker; µs per key, median of {args.rounds} rounds")
        print("| batch | hit µs/key | miss µs/key | hit batch ms | miss batch ms |")
        print("| ---: | ---: | ---: | ---: | ---: |")
        for n in batches:
            hit_t, miss_t = [], []
            for _ in range(args.rounds):
                hits = rng.sample(keys, n)
                misses = ["".join(rng.choice(_HEX) for _ in range(32)) for _ in range(n)]
                a = time.perf_counter()
                got = lookup.lookup(topic, hits, begin, end)
                b = time.perf_counter()
                gone = lookup.lookup(topic, misses, begin, end)
                c = time.perf_counter()
                assert all(r.state is LookupState.FOUND for r in got.values()), "a sent key not found"
                assert all(r.state is LookupState.MISSING for r in gone.values()), "a random key found"
                hit_t.append((b - a) / n)
                miss_t.append((c - b) / n)
            h, m = statistics.median(hit_t), statistics.median(miss_t)
            print(f"| {n} | {h * 1e6:.0f} | {m * 1e6:.0f} | {h * n * 1e3:.2f} | {m * n * 1e3:.2f} |")


if __name__ == "__main__":
    main()
