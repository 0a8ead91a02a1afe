"""The segment churn soak's long form: `timewheel serve` with one-minute segments and 36 s of
retention on a RocketMQ of its own, under steady load, sampled from /proc (tests/reliability/segment_churn.py).

    python -m bench.soak --minutes 30 [--rate 200] [--max-delay-s 90] [--out FILE]

Prints a table of samples (memory, threads, descriptors, files held) and the delivery tally; exits 1
if a message was lost or delivered twice, no segment was retired, or the process held a deleted or
retired file.
"""
from __future__ import annotations

import sys

from tests.reliability.segment_churn import main

if __name__ == "__main__":
    sys.exit(main())
