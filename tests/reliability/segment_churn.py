"""Segment churn: what a process that runs for months goes through every hour, sixty times faster.

`timewheel serve` runs on a real local RocketMQ with one-minute segments and a retention of 36 s,
under steady load (messages due 1 s to `--max-delay-s` ahead, so every segment fills, comes due,
is delivered, sealed, unloaded and retired in turn). The harness samples the process from /proc
every few seconds and reads what its consumer really received:

- every message acknowledged to the producer is delivered, once;
- no descriptor or memory map of the process holds a deleted file of the data directory (a
  deleted file held open keeps its disk space: retention would free nothing), and none points into
  a retired segment;
- at every sample, messages sent recently, a while ago and long ago (perhaps retired) are looked
  up by key through the admin endpoint and read-only beside the engine (`timewheel find`): no
  look-up fails, and none calls a message anything but pending or delivered (or not found);
- descriptors under `schedule/`, threads, resident memory (and the meta store's block cache, from
  `/metrics`) and the data directory's bytes are reported per sample, to see that they stay flat
  while segments come and go.

    python -m bench.soak --minutes 30 [--rate 200] [--max-delay-s 90]   # the long form
    python -m bench.soak --minutes 20 --kill-every-s 20                   # with SIGKILLs and restarts

The CI form (about 2 minutes) is tests/reliability/test_segment_churn.py.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from forwarder.local_rocketmq import LocalRocketMQ
from tests.ports import free_port
from tests.reliability.kill_loop import serve_env, start_serve
from tests.reliability.steady_load import SteadyLoad

#: the engine's settings that make an hour a minute: segments, their preload, retention (36 s), and
#: checkpoints (retention runs with them) every 2 s
CHURN_SETTINGS = {"TIMEWHEEL_ENGINE_SEGMENT_MINUTES": "1", "TIMEWHEEL_ENGINE_PRELOAD_SECONDS": "10",
                  "TIMEWHEEL_ENGINE_RETENTION_HOURS": "0.01", "TIMEWHEEL_ENGINE_CHECKPOINT_SECONDS": "2"}
_DELETED = " (deleted)"


@dataclass
class Sample:
    """One look at the serve process."""

    t: float  # seconds since the load began
    rss_mb: float
    threads: int
    fds: int
    schedule_fds: int  # descriptors on files under schedule/
    deleted_held: int  # descriptors and maps on deleted files of the data directory
    on_retired: int  # descriptors and maps on files of segments retired by then
    segments: int  # segment directories on disk
    retired: int  # segments retired so far
    data_mb: float  # bytes of the files in the data directory
    meta_cache_mb: float  # the meta store's block cache, from /metrics (-1: not read)
    kills: int = 0  # SIGKILLs of the engine so far (with `kill_every_s`)


@dataclass
class ChurnResult:
    """What the run saw; `problems` is empty when every check held."""

    seconds: float
    acknowledged: int
    delivered: int
    lost: int
    duplicates: int  # second copies stored on the target
    segments_retired: int
    redeliveries: int = 0  # the test consumer handing a stored copy over again (not the engine's doing)
    duplicate_copies: list[str] = field(default_factory=list)  # the first few duplicates' copies
    kill_ms: list[int] = field(default_factory=list)  # when each SIGKILL was sent (epoch ms)
    samples: list[Sample] = field(default_factory=list)
    held_deleted: list[str] = field(default_factory=list)  # the first few such files, to name them
    kills: int = 0  # SIGKILLs of the engine (each followed by a start)
    lookups: int = 0  # look-ups by key made during the run (admin endpoint and beside the engine)
    found_states: dict[str, int] = field(default_factory=dict)  # what the look-ups answered, "none" for not found
    lookup_failures: list[str] = field(default_factory=list)  # the first few that failed or said something wrong
    problems: list[str] = field(default_factory=list)


def _targets(pid: int, root: Path) -> list[str]:
    """Files under `root` the process holds: its descriptors' targets and its file-backed maps."""
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:  # closed meanwhile
            continue
    with open(f"/proc/{pid}/maps") as maps:
        out += {line.split(None, 5)[5].rstrip("\n") for line in maps if len(line.split(None, 5)) == 6}
    return [t for t in out if t.startswith(str(root))]


def _meta_cache_mb(admin_port: int) -> float:
    """The engine's `timewheel_meta_store_memory_bytes{kind="block_cache"}` in MB (-1 if unread)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return -1.0
    for line in text.splitlines():
        if line.startswith('timewheel_meta_store_memory_bytes{kind="block_cache"}'):
            return round(float(line.split()[-1]) / 2**20, 1)
    return -1.0


def _sample(pid: int, admin_port: int, data: Path, t0: float, seen: set[str]) -> tuple[Sample, list[str]]:
    schedule = data / "schedule"
    present = {p.name for p in schedule.iterdir()} if schedule.exists() else set()
    seen |= present
    retired = seen - present
    held = _targets(pid, data)
    deleted = [t for t in held if t.endswith(_DELETED)]
    on_retired = [t for t in held if Path(t.removesuffix(_DELETED)).parent.name in retired]
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return Sample(round(time.monotonic() - t0, 1), round(int(status["VmRSS"].split()[0]) / 1024, 1),
                  int(status["Threads"]), len(os.listdir(f"/proc/{pid}/fd")),
                  sum(1 for t in held if t.startswith(str(schedule)) and not t.endswith(_DELETED)),
                  len(deleted), len(on_retired), len(present), len(retired), round(_bytes_under(data) / 2**20, 1),
                  _meta_cache_mb(admin_port)), deleted


#: where in what was acknowledged so far the keys looked up at each sample are taken from
_PICKS = (0.0, 0.3, 0.7, 0.99, 1.0)
_TOKEN = "churn-token"


def _look_up(admin_port: int, data: Path, keys: list[str], states_seen: dict[str, int]) -> tuple[int, list[str]]:
    """Each key looked up by the admin endpoint and by a finder beside the engine; what was wrong
    (what each answered is counted into `states_seen`)."""
    from timewheel.find import MessageFinder

    wrong = []
    now = time.time_ns() // 1_000_000
    for key in keys:
        req = urllib.request.Request(f"http://127.0.0.1:{admin_port}/messages?key={key}",
                                     headers={"Authorization": f"Bearer {_TOKEN}"})
        answers = []
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                answers.append(("admin", json.loads(resp.read())))
            with MessageFinder.beside_engine(data) as finder:
                answers.append(("beside", finder.by_key(key, now).to_dict()))
        except Exception as e:  # noqa: BLE001 - the checker reports it
            wrong.append(f"{key}: {type(e).__name__}: {e}")
            continue
        for how, found in answers:
            states = [m["state"] for m in found["messages"]]
            for state in states or ["none"]:
                states_seen[state] = states_seen.get(state, 0) + 1
            if found["count"] > 1 or not set(states) <= {"pending", "delivered"}:
                wrong.append(f"{key} ({how}): {states}")
    return len(keys) * 2, wrong


def _bytes_under(root: Path) -> int:
    """Bytes of the files under `root` (those removed while it is walked are skipped)."""
    total = 0
    for path in root.rglob("*"):
        try:
            total += path.stat().st_size if path.is_file() else 0
        except OSError:
            continue
    return total


def run_churn(mq: LocalRocketMQ, seconds: float, work: Path, *, rate: int = 200, max_delay_s: float = 90.0,
              sample_every_s: float = 5.0, drain_timeout: float = 180.0, kill_every_s: float = 0.0,
              seed: int = 0) -> ChurnResult:
    """Run the load for `seconds` against a started RocketMQ, then drain; returns what was seen.

    With `kill_every_s`, the engine is also killed (SIGKILL) at random moments, on average that often
    while the load runs (so in the middle of sealing, loading, checkpoints and retirements too), and
    started again at once: nothing may be lost, and with the engine's look-ups (`dedupe`, on by
    default) nothing delivered twice either."""
    run = uuid.uuid4().hex[:8]
    delay_topic, target = f"TW_DELAY_{run}", f"CHURN_{run}"
    mq.create_topics([delay_topic, f"TW_DLQ_{run}", target], queues=4)
    data = work / "data"
    env = serve_env(mq, run, TIMEWHEEL_ADMIN_TOKEN=_TOKEN, **CHURN_SETTINGS)
    admin_port = free_port()
    proc = start_serve(data, env, work / "serve.log", admin_port)
    rng = random.Random(seed)
    spread_ms = max(1, int((max_delay_s - 1) * 1000))
    load = SteadyLoad(mq, run, delay_topic, target, rate=rate, due_in_ms=lambda i: 1000 + (i * 7919) % spread_ms,
                      name="churn")
    result = ChurnResult(0.0, 0, 0, 0, 0, 0)
    seen: set[str] = set()
    t0 = time.monotonic()

    def look() -> None:
        sample, deleted = _sample(proc.pid, admin_port, data, t0, seen)
        sample.kills = result.kills
        result.samples.append(sample)
        result.held_deleted += [d for d in deleted if d not in result.held_deleted][:10 - len(result.held_deleted)]
        n, wrong = _look_up(admin_port, data, load.acknowledged_keys(_PICKS), result.found_states)
        result.lookups += n
        result.lookup_failures += wrong[:10 - len(result.lookup_failures)]

    try:
        load.start()
        next_look = t0 + sample_every_s
        next_kill = t0 + rng.uniform(0.5, 1.5) * kill_every_s if kill_every_s else float("inf")
        while time.monotonic() - t0 < seconds:
            time.sleep(max(0.0, min(next_look, next_kill) - time.monotonic()))
            if time.monotonic() >= next_kill:
                result.kill_ms.append(time.time_ns() // 1_000_000)
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                result.kills += 1
                admin_port = free_port()
                proc = start_serve(data, env, work / "serve.log", admin_port)
                next_kill = time.monotonic() + rng.uniform(0.5, 1.5) * kill_every_s
            if time.monotonic() >= next_look:
                look()
                next_look += sample_every_s
        load.stop_producing()
        load.wait_delivered(max_delay_s + drain_timeout, poll_s=1.0)
        time.sleep(1.0)  # a duplicate would arrive within this
        look()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        load.close()
    tally = load.tally()
    result.acknowledged, result.delivered, result.lost, result.duplicates = \
        tally.acknowledged, tally.delivered, tally.lost, tally.duplicates
    result.redeliveries, result.duplicate_copies = tally.redeliveries, list(tally.duplicate_copies)
    result.seconds = round(time.monotonic() - t0, 1)
    result.segments_retired = max((s.retired for s in result.samples), default=0)
    result.problems = _problems(result)
    return result


def _problems(r: ChurnResult) -> list[str]:
    """What the checks found wrong (none: the run passed)."""
    out = []
    if r.lost:
        out.append(f"{r.lost} of {r.acknowledged} acknowledged messages not delivered")
    if r.duplicates:
        out.append(f"{r.duplicates} duplicates stored on the target (kills at {r.kill_ms} epoch ms): "
                   f"{r.duplicate_copies}")
    if not r.segments_retired:
        out.append("no segment was retired: the run proves nothing about retention")
    if held := max((s.deleted_held for s in r.samples), default=0):
        out.append(f"up to {held} descriptors or maps held deleted files, e.g. {r.held_deleted[:3]}")
    if on := max((s.on_retired for s in r.samples), default=0):
        out.append(f"up to {on} descriptors or maps pointed into retired segments")
    if r.lookup_failures:
        out.append(f"look-ups by key failed or were wrong: {r.lookup_failures[:3]}")
    if not {"pending", "delivered"} <= r.found_states.keys():
        out.append(f"the look-ups never found both a pending and a delivered message: {r.found_states}")
    return out


def table(r: ChurnResult) -> str:
    """The samples as a Markdown table, then the tally."""
    rows = ["| t s | RSS MB | meta cache MB | threads | fds | schedule/ fds | deleted held | on retired | segments | "
            "retired | data MB | kills |", "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    rows += [f"| {s.t:.0f} | {s.rss_mb:.1f} | {s.meta_cache_mb:.1f} | {s.threads} | {s.fds} | {s.schedule_fds} | "
             f"{s.deleted_held} | {s.on_retired} | {s.segments} | {s.retired} | {s.data_mb:.1f} | {s.kills} |"
             for s in r.samples]
    rows.append(f"\n{r.acknowledged} acknowledged, {r.delivered} delivered, {r.lost} lost, {r.duplicates} "
                f"duplicates stored, {r.redeliveries} redelivered by the consumer; {r.segments_retired} segments "
                f"retired and {r.kills} kills in {r.seconds:.0f} s; "
                f"{r.lookups} look-ups by key "
                f"({r.found_states}), {len(r.lookup_failures)} wrong")
    rows.append("every check held" if not r.problems else "PROBLEMS: " + "; ".join(r.problems))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """The long form: its own local RocketMQ; prints the table, writes the JSON with --out."""
    ap = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0, help="how long the load runs (then it drains)")
    ap.add_argument("--rate", type=int, default=200, help="producer messages per second")
    ap.add_argument("--max-delay-s", type=float, default=90.0, help="messages are due 1 s to this far ahead")
    ap.add_argument("--sample-every-s", type=float, default=15.0, help="seconds between looks at the process")
    ap.add_argument("--kill-every-s", type=float, default=0.0,
                    help="also SIGKILL the engine at random moments about this often (0: never), restarting it")
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    ap.add_argument("--out", type=Path, help="also write the result as JSON here")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="tw-soak-"))
    with LocalRocketMQ(work / "mq", stop_timeout=3.0) as mq:
        result = run_churn(mq, args.minutes * 60, work, rate=args.rate, max_delay_s=args.max_delay_s,
                           sample_every_s=args.sample_every_s, kill_every_s=args.kill_every_s, seed=args.seed)
    print(table(result))
    if args.out:
        args.out.write_text(json.dumps(asdict(result), indent=1))
    return 1 if result.problems else 0


if __name__ == "__main__":
    sys.exit(main())
