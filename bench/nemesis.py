"""The fault-injection harness's long form: one shard of replicas on a RocketMQ and a ZooKeeper of
its own, `--rounds` faults of every kind in turn, then the table of rounds (tests/coordination/nemesis.py).

    python -m bench.nemesis --rounds 24 [--replicas 2] [--rate 100] [--faults kill,pause]

With `--faults`, the kinds named go in turn for `--rounds` rounds (one of each without it).

Exits 1 if the checker found anything (lost messages, cancelled ones delivered, a slow takeover,
duplicates above the bound, a deposed holder sending, a duplicate id accepted, a copy stored while
ZooKeeper was down or empty, a replica that an empty ZooKeeper refused without saying so).
"""
from __future__ import annotations

import sys

from tests.coordination.nemesis import main

if __name__ == "__main__":
    sys.exit(main())
