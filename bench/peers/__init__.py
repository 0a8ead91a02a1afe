"""Latency benchmarks of timewheel against its peers, side by side in one run.

    python -m bench.peers run            # the default run (~10-15 min on 2 cores)
    python -m bench.peers run --help     # flags to scale each workload up
    python -m bench.peers report         # rebuild RESULTS.md and the chart from the JSON
    python -m bench.peers ab REV --out DIR   # timewheel's target rows: REV and this checkout, alternating
    python -m bench.peers ab REV --bench peers --bench capacity --bench burst --out DIR   # every target

The same workloads run against six systems, one after another, on one machine:

- `timewheel`: `timewheel serve` as a subprocess, fed through the local RocketMQ's delay topic and
  delivering to a target topic a consumer reads;
- `rocketmq-timer`: RocketMQ 5's own timer messages (`TIMER_DELIVER_MS`) on the same broker;
- `rocketmq-levels`: RocketMQ's 18 delay levels (`DELAY`), the nearest level at or above the wanted
  delay, lateness measured against the wanted due time;
- `redis-zset`: a Redis sorted set, a Lua script moving due members to a ready list, BLPOP consumers;
- `postgres`: a table indexed on due time, pollers claiming batches with `FOR UPDATE SKIP LOCKED`;
- `heapq`: an in-memory heap and a release thread on a condition variable (how Pulsar's in-memory
  tracker works), positions in memory, bodies in an append-only log it rebuilds from on restart.

Reference rows measure the broker alone: `plain-hop` (plain messages through it, no delay),
`intake-ceiling` (what RocketMQ's Java producer pushes in), `noop-consumer` (what RocketMQ's Java pull
consumer reads out).

Workloads: `steady` (a paced producer, delays spread over a window; for the plain hop and timewheel also
at 10k/s, produced and consumed by RocketMQ's Java clients), `burst` (many messages due in the
same second), `horizon` (messages spread over days: memory per pending message and
restart-to-first-delivery, without waiting for them). Modules: `common` (recording, percentiles,
processes), `servers` (Redis and PostgreSQL started on loopback), `systems` (one adapter per
system), `heap_engine` (the heapq engine), `runner` (the workloads), `java_workloads` (those run with
RocketMQ's Java clients), `report` (table, chart, RESULTS.md), `ab` (two revisions' target rows, alternating), `ab_rows` (those rows, read
from each benchmark's results), `cli`.
"""
