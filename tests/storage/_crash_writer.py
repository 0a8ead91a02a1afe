"""A writer process for the crash test: appends batches forever, printing the ids of each batch
only after its append returned (that is, after it was acknowledged)."""
from __future__ import annotations

import random
import sys
from typing import cast

from storage import FlushPolicy, Record, ScheduleStore

HOUR = 3_600_000


def main() -> None:
    data_dir, round_no = sys.argv[1], int(sys.argv[3])
    flush = cast(FlushPolicy, sys.argv[2])  # test_crash passes "async" or "sync"
    now = 1_800_000_000_000 + round_no * 1000
    rng = random.Random(round_no)
    store = ScheduleStore(data_dir, flush=flush, checkpoint_bytes=256 << 10)
    print("ready", flush=True)
    batch_no = 0
    while True:
        n = rng.randint(1, 200)
        batch = [Record(f"r{round_no}-b{batch_no}-{i}", "T", rng.randbytes(rng.randint(0, 400)),
                        now + rng.randint(0, 72) * HOUR + rng.randint(0, HOUR), keys=(f"k{i % 7}",))
                 for i in range(n)]
        store.append(batch, now)
        sys.stdout.write(" ".join(r.msg_id for r in batch) + "\n")
        sys.stdout.flush()
        batch_no += 1


if __name__ == "__main__":
    main()
