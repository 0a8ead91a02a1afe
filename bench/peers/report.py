"""Tables, ratios, the lateness chart and RESULTS.md, all computed from a run's JSON."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.peers.common import RESULTS_DIR, RESULTS_MD
from bench.peers.cpu import window_cpu

#: Rows that measure the broker itself, not a delay system: shown against timewheel, not among the peers.
REFERENCES = ("plain-hop", "intake-ceiling", "noop-consumer")
#: The reference rows with a rate and no lateness.
RATE_ROWS = ("intake-ceiling", "noop-consumer")

LABELS = {
    "plain-hop": "plain messages through the same broker, producer and consumer (no delay)",
    "intake-ceiling": "RocketMQ's own Java producer, batches from several threads",
    "noop-consumer": "RocketMQ's own Java lite pull consumer reading a backlog, doing nothing with it",
    "timewheel": "timewheel (delay topic → engine → target topic)",
    "rocketmq-timer": "RocketMQ 5 timer (`TIMER_DELIVER_MS`)",
    "rocketmq-levels": "RocketMQ delay levels (`DELAY`)",
    "redis-zset": "Redis ZSET + Lua mover + BLPOP",
    "postgres": "PostgreSQL table, SKIP LOCKED pollers",
    "heapq": "in-memory heapq engine (Pulsar-style)",
}


def _get(d: Any, *path: str) -> Any:
    """d[path[0]][path[1]]... or None: a value of a JSON document, of whatever type the document holds there."""
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def _ms(x: object) -> str:
    """A lateness in ms, readable at a glance."""
    if not isinstance(x, (int, float)):
        return "–"
    if abs(x) >= 10_000:
        return f"{x / 1000:,.1f} s"
    if abs(x) >= 100:
        return f"{x:,.0f}"
    return f"{x:.1f}"


def _num(x: object, digits: int = 0) -> str:
    if not isinstance(x, (int, float)):
        return "–"
    return f"{x:,.{digits}f}"


def lateness_table(doc: dict) -> str:
    """Markdown: lateness percentiles of steady and burst per system."""
    head = ("| system | steady p50 | p99 | p999 | max | burst p50 | p99 | p999 | max | received (steady, burst) |\n"
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n")
    rows = []
    for name, r in doc["systems"].items():
        if name in RATE_ROWS:
            continue
        cells = [f"{name}"]
        for phase in ("steady", "burst"):
            lat = _get(r, phase, "lateness_ms") or {}
            cells += [_ms(lat.get("p50")), _ms(lat.get("p99")), _ms(lat.get("p999")), _ms(lat.get("max"))]
        got = []
        for phase in ("steady", "burst"):
            p = _get(r, phase) or {}
            got.append(f"{_num(p.get('received'))}/{_num(p.get('accepted'))}" if "accepted" in p
                       else ("error" if phase in p or "error" in p else "–"))
        cells.append(", ".join(got))
        rows.append("| " + " | ".join(cells) + " |")
    return head + "\n".join(rows) + "\n"


def _cpu_per_msg(r: dict, phase: str = "steady", engine_only: bool = False) -> str:
    """CPU time of the system's own processes during a steady phase, per message accepted in it (the engine
    process alone, without the broker, if `engine_only`)."""
    cpu = _get(r, phase, "server_cpu_s")
    n = _get(r, phase, "accepted")
    if not isinstance(cpu, dict) or not cpu or not isinstance(n, int) or not n:
        return "–"
    warm = _get(r, phase, "warm_up_sent")  # the high rate's warm-up ran in the phase too
    n += warm if isinstance(warm, int) else 0
    spent = sum(v for k, v in cpu.items() if not (engine_only and "broker" in k))
    return f"{spent / n * 1e6:,.0f}"


def capacity_table(doc: dict) -> str:
    """Markdown: ingest rate, memory and disk per pending message, restart-to-first-delivery."""
    head = ("| system | ingest msg/s | pending (horizon) | memory B/pending | disk B/pending | "
            "server CPU µs/msg (steady) | restart → first delivery | notes |\n"
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n")
    rows = []
    for name, r in doc["systems"].items():
        if name in REFERENCES:
            continue
        b = _get(r, "burst") or {}
        h = _get(r, "horizon") or {}
        mem = h.get("memory") or {}
        restart = h.get("restart") or {}
        notes = list(r.get("notes") or [])
        if h.get("capped_by_system"):
            notes.insert(0, f"horizon {h.get('span_days')} days (system maximum)")
        if restart.get("warning"):
            notes.append(restart["warning"])
        for key in ("error",):
            for phase in ("steady", "burst", "horizon"):
                if _get(r, phase, key):
                    notes.append(f"{phase}: {_get(r, phase, key)}")
            if r.get(key):
                notes.append(str(r[key]))
        dups = _get(r, "burst", "diagnostics", "duplicates_total")
        if isinstance(dups, (int, float)) and dups > 0:
            notes.append(f"{dups:.0f} distinct messages dropped as duplicates by the engine (the client gave "
                         "them the UNIQ_KEY of another message when sending from several threads)")
        first = restart.get("first_delivery_s")
        rows.append("| " + " | ".join([
            name, _num(b.get("ingest_stored_per_s")), _num(h.get("pending")), _num(mem.get("bytes_per_pending"), 1),
            _num(mem.get("disk_per_pending"), 1), _cpu_per_msg(r), f"{first:.2f} s" if isinstance(first, (int, float)) else "–",
            "; ".join(str(n).replace("|", "/") for n in notes)]) + " |")
    return head + "\n".join(rows) + "\n"


def ratios(doc: dict) -> list[tuple[str, str, float | None]]:
    """(peer, figure, ratio) with each ratio oriented so that >1 means timewheel is better."""
    tw = doc["systems"].get("timewheel")
    out: list[tuple[str, str, float | None]] = []
    if not tw:
        return out
    figures = [
        ("steady p99 lateness", ("steady", "lateness_ms", "p99"), False),
        ("steady p999 lateness", ("steady", "lateness_ms", "p999"), False),
        ("burst p99 lateness", ("burst", "lateness_ms", "p99"), False),
        ("burst max lateness", ("burst", "lateness_ms", "max"), False),
        ("ingest rate", ("burst", "ingest_stored_per_s"), True),
        ("memory per pending", ("horizon", "memory", "bytes_per_pending"), False),
        ("restart to first delivery", ("horizon", "restart", "first_delivery_s"), False),
    ]
    for name, r in doc["systems"].items():
        if name == "timewheel" or name in REFERENCES:
            continue
        for label, path, higher_better in figures:
            a, b = _get(tw, *path), _get(r, *path)
            ratio = None
            if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a > 0 and b > 0:
                ratio = a / b if higher_better else b / a
            out.append((name, label, ratio))
    return out


def ratio_table(doc: dict) -> str:
    """Markdown: peer ÷ timewheel (or timewheel ÷ peer for rates); above 1 favours timewheel."""
    rows = ratios(doc)
    labels = list(dict.fromkeys(label for _, label, _ in rows))
    peers = list(dict.fromkeys(p for p, _, _ in rows))
    head = "| figure | " + " | ".join(peers) + " |\n| --- |" + " ---: |" * len(peers) + "\n"
    lines = []
    for label in labels:
        cells = []
        for p in peers:
            v = next((r for q, lab, r in rows if q == p and lab == label), None)
            cells.append("–" if v is None else (f"{v:,.0f}×" if v >= 100 else f"{v:.3g}×"))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n"


def _dispatch_rate(r: dict) -> float | None:
    """Messages a second delivered in the burst: all of them over the time from their due millisecond
    to the last one's arrival."""
    got, after = _get(r, "burst", "received"), _get(r, "burst", "all_received_after_due_ms")
    if isinstance(got, int) and isinstance(after, (int, float)) and after > 0:
        return got / (after / 1000)
    return None


def _ratio(a: object, b: object) -> str:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0:
        return f"{a / b:.2f}"
    return "–"


def floor_tables(doc: dict) -> str:
    """Markdown: timewheel against the broker's own floor (plain hop, intake ceiling, no-op consumer), from the
    same run."""
    systems = doc["systems"]
    tw, hop, ceiling = systems.get("timewheel"), systems.get("plain-hop"), systems.get("intake-ceiling")
    noop = systems.get("noop-consumer")
    if not tw or not (hop or ceiling or noop):
        return ("(run with `--system plain-hop --system intake-ceiling --system noop-consumer --system timewheel` "
                "for this section)\n")
    out = ["| steady workload | clients | plain hop p50 | p99 | timewheel p50 | p99 | p99 ÷ plain hop | "
           "p50 − plain hop | engine CPU µs/msg | broker CPU µs/msg | producer reached |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for phase in ("steady", "steady_high"):
        t, h = _get(tw, phase, "lateness_ms") or {}, _get(hop, phase, "lateness_ms") or {}
        if not t:
            continue
        diff = (t["p50"] - h["p50"]) if "p50" in t and "p50" in h else None
        stalled = plain_hop_stalled(h)
        engine = _cpu_per_msg(tw, phase, engine_only=True)
        total = _cpu_per_msg(tw, phase)
        broker = "–"
        if engine != "–" and total != "–":
            broker = f"{float(total.replace(',', '')) - float(engine.replace(',', '')):,.0f}"
        out.append("| " + " | ".join([
            f"{_get(tw, phase, 'rate') or doc['config']['steady_rate']:,}/s", _clients(tw, phase),
            _ms(h.get("p50")), _ms(h.get("p99")),
            _ms(t.get("p50")), _ms(t.get("p99")),
            "– (plain hop stalled)" if stalled else _ratio(t.get("p99"), h.get("p99")),
            f"{diff:+.1f}" if isinstance(diff, (int, float)) and not stalled else "–", engine, broker,
            f"{_num(_get(tw, phase, 'producer_rate'))}/s"]) + " |")
    win = window_cpu(tw, "steady_high")
    if win is not None and win[1] > 0:
        engine_s, broker_s, n = win
        w = _get(tw, "steady_high", "steady_window") or {}
        threads = w.get("engine_threads_cpu_s") or {}
        out += ["", f"The 10k/s phase's steady part alone (its last {w['seconds']:g} s of sending, once what the "
                "stream sends comes due at the full rate: both ingest and delivery at 10k/s; the row above also "
                "holds the ramp, storing only, and the drain, delivering at a falling rate): engine "
                f"{engine_s / n * 1e6:,.1f} µs a message, broker {broker_s / n * 1e6:,.1f}, engine ÷ broker "
                f"**{engine_s / broker_s:.3f}**" + (" (by thread: " + ", ".join(
                    f"{k} {v / n * 1e6:,.1f}" for k, v in sorted(threads.items(), key=lambda kv: -kv[1])) + ")"
                    if threads else "") + "."]
        queued = w.get("run_queue_s") or {}
        if queued and w.get("seconds"):
            engine_q = sum(v for k, v in queued.items() if "broker" not in k)
            broker_q = sum(queued.values()) - engine_q
            out[-1] += (f" Meanwhile their threads waited in the kernel's run queue for a CPU: the engine's "
                        f"{engine_q / w['seconds'] * 1000:,.0f} ms a second, the broker's "
                        f"{broker_q / w['seconds'] * 1000:,.0f} ms a second (/proc schedstat; the machine's "
                        f"{_get(doc, 'machine', 'cpus') or '?'} CPUs are shared with the Java producer and consumer).")
    split = [_thread_split(tw, phase) for phase in ("steady", "steady_high", "batch_ingest")]
    if any(split):
        out += ["", "Where the engine's CPU went, by thread (µs a message; the threads' names for the OS: "
                "`tw-in` pulls and stores, `tw-timer` turns the wheel, `tw-dispatch` reads, sends and records):", ""]
        out += [f"- {label}: {text}" for label, text in zip(
            ("steady 1k/s", "steady 10k/s", "batch ingest"), split) if text]
    cap, read = _get(ceiling, "intake", "rate"), _get(noop, "read", "rate")
    rows = [("broker intake ceiling: RocketMQ's Java producer, "
             f"{_get(ceiling, 'intake', 'threads')} threads × batches of {_get(ceiling, 'intake', 'batch')}", cap),
            ("no-op consumer: RocketMQ's Java lite pull consumer reading a backlog" + (
                f" of {_num(_get(noop, 'read', 'backlog'))} from {_get(noop, 'read', 'queues')} queues, "
                f"{_get(noop, 'read', 'pull_batch')} a pull" if read is not None else " (not run)"), read),
            ("timewheel ingest: the same Java producer sending delay messages (stored per second, "
             "from the first to the last stored, the producer beside it for its first seconds)",
             _get(tw, "batch_ingest", "stored_per_s")),
            ("timewheel ingest: the same, once the producer finished (the backlog it left"
             + (f", {_num(_get(tw, 'batch_ingest', 'backlog_at_producer_end'))} messages" if
                _get(tw, "batch_ingest", "backlog_at_producer_end") is not None else "")
             + ", read as the no-op consumer reads its own)",
             _get(tw, "batch_ingest", "stored_per_s_backlog_alone")),
            ("timewheel ingest: 8 threads of single sends through the Python client (burst)",
             _get(tw, "burst", "ingest_stored_per_s")),
            (f"timewheel dispatch: {doc['config']['burst']:,} due in one millisecond, all delivered",
             _dispatch_rate(tw))]
    out += ["", "| rate | msg/s | ÷ intake ceiling | ÷ no-op consumer |", "| --- | ---: | ---: | ---: |"]
    out += [f"| {label} | {_num(v)} | {_ratio(v, cap)} | {_ratio(v, read)} |" for label, v in rows]
    return "\n".join(out) + "\n"


def _thread_split(r: dict, phase: str) -> str:
    """The engine's CPU in a phase by thread group, per message of the phase ("" when not measured)."""
    threads = _get(r, phase, "engine_threads_cpu_s")
    n = _get(r, phase, "accepted") or _get(r, phase, "stored")  # as `_cpu_per_msg` counts them
    if not isinstance(threads, dict) or not threads or not isinstance(n, int) or not n:
        return ""
    warm = _get(r, phase, "warm_up_sent")
    n += warm if isinstance(warm, int) else 0
    return ", ".join(f"{k} {v / n * 1e6:,.1f}" for k, v in sorted(threads.items(), key=lambda kv: -kv[1]))


def _clients(r: dict, phase: str) -> str:
    """Who produced and who consumed a steady phase (runs before the Java consumer have no `consumer`)."""
    if phase == "steady":
        return "Python"
    consumer = _get(r, phase, "consumer")
    return "Java → Java" if consumer else "Java → Python"


def chart(doc: dict, path: Path) -> None:
    """CDFs of steady (and, where measured, high-rate steady) and burst lateness per system, symmetric-log
    x axis (ms)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    phases = ["steady", "burst"]
    high = [r for r in doc["systems"].values() if _get(r, "steady_high", "quantiles_ms")]
    if high:
        phases.insert(1, "steady_high")
    clients = "Java producer and consumer" if any(_get(r, "steady_high", "consumer") for r in high) else "Java producer"
    fig, axes = plt.subplots(1, len(phases), figsize=(6.5 * len(phases), 5), sharey=True)
    # one colour per system in every panel (a system missing from one must not shift the others')
    colours = {name: f"C{i}" for i, name in enumerate(doc["systems"])}
    for ax, phase in zip(axes, phases):
        for name, r in doc["systems"].items():
            q = _get(r, phase, "quantiles_ms")
            if not q:
                continue
            ax.plot(q, np.linspace(0, 1, len(q)), label=name, lw=1.8, color=colours[name])
        ax.set_xscale("symlog", linthresh=1.0)
        ax.set_xlabel("lateness, ms (receive time − due time; symlog)")
        c = doc["config"]
        delays = f"delays {c['delay_min_ms'] / 1000:g}–{c['delay_max_ms'] / 1000:g} s"
        titles = {"steady": f"steady: {c['steady_rate']:,}/s for {c['steady_seconds']:g} s, {delays}",
                  "steady_high": f"steady: {c.get('steady_high_rate', 0):,}/s for {c.get('steady_high_seconds', 0):g} s, "
                                 f"{delays}\nRocketMQ's {clients}",
                  "burst": f"burst: {c['burst']:,} due in the same millisecond"}
        ax.set_title(titles[phase], fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.axvline(0, color="grey", lw=0.8)
    axes[0].set_ylabel("fraction of messages")
    handles, labels = [], []
    for ax in axes:  # every system once, whichever panel it is in
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    if labels:
        fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9, frameon=False)
    else:  # every system failed: the chart says so rather than the run ending on matplotlib's error
        fig.text(0.5, 0.02, "no system has lateness figures: see each system's error in the report",
                 ha="center", fontsize=10)
    fig.suptitle(f"Lateness CDF, {doc['machine']['date']}, {doc['machine']['cpus']} CPUs, "
                 f"load avg {doc['load_average_start'][0]}")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


_METHOD = """\
## What each system is

| system | how it is run and measured |
| --- | --- |
| plain-hop | reference: the timewheel row's producer (`rocketmq-client-python`, sync sends from 8 threads) sends plain messages to `PEER_PLAIN`, read by the same kind of native push consumer; lateness is receive − send time. It runs the steady workloads only. At the high rate both ends are RocketMQ's Java clients (`forwarder/java/JavaClient.java`): `pace` sends to `PEER_PLAIN_JAVA`, stamping each message's send time (µs) in `BENCH_DUE_MS`, and `lateness`, a push consumer (4 consume threads) in a fresh group that alone reads that topic, takes each message's receive time (µs) − `BENCH_DUE_MS` and reports 1001 quantiles (and p50, p99, max for each second of receive time, in the JSON). The stream starts a few seconds (`--steady-high-warm-up-s`) before the measured messages, numbered apart: both clients' JVMs start cold for the phase, and their first second would otherwise be the p99. |
| intake-ceiling | reference: RocketMQ's own Java producer (`forwarder/java/JavaClient.java`, `intake`) sending batches from several threads to a plain topic for a fixed time; the rate the broker acknowledged. |
| noop-consumer | reference: the intake ceiling's producer fills `PEER_NOOP` (8 queues) for the same time, then RocketMQ's own Java lite pull consumer (`JavaClient.java`, `noop`; a fresh group from the first offset, the pull batch of timewheel's consumer) reads the backlog and does nothing with it; the rate is messages over the time from its first to its last poll answer, without start-up and rebalance. What the broker hands one consumer per second: the yardstick for the engine's ingest, itself a pull consumer. |
| timewheel | `python -m timewheel serve` as a subprocess (defaults: 500 ms wheel, hourly segments, async flush), fed by the local RocketMQ's `TW_DELAY` topic (`TW_TARGET_TOPIC`, `TW_DELIVER_AT_MS`), delivering to `PEER_TW_OUT`, read by a native push consumer in the harness. Ingest rate counts a message once the engine has stored it (its `scheduled` counter), not when the broker acknowledged it. At the high rate both ends are RocketMQ's Java clients, as for the plain hop: `pace` sends delay messages (due in `BENCH_DUE_MS`, the same value as `TW_DELIVER_AT_MS`) for the target `PEER_TW_OUT_JAVA`, which only the `lateness` consumer reads. |
| rocketmq-timer | the same broker's timer messages: `TIMER_DELIVER_MS` on a normal topic, broker defaults (`timerPrecisionMs=1000`, `timerMaxDelaySec=259200`). |
| rocketmq-levels | the same broker's delay levels: `DELAY` = the smallest of `1s 5s 10s 30s 1m … 2h` at or above the wanted delay; lateness is against the wanted due time, so the rounding shows. |
| redis-zset | Debian's `redis-server` on loopback (AOF, `appendfsync everysec`); producers `ZADD` (one command per batch, pipelined for the bulk load); one poller runs a Lua script moving up to 1000 due members to a list atomically, sleeping until the earliest score or the poll interval; two consumers `BLPOP` + `LPOP 255`. |
| postgres | Debian's PostgreSQL, `initdb` in a temp dir, on loopback (`synchronous_commit=off`, as the others flush asynchronously); table `(id pk, due_ms, body)` with an index on `due_ms`; producers `COPY`; two pollers each `DELETE … WHERE id IN (SELECT … WHERE due_ms <= now ORDER BY due_ms LIMIT 500 FOR UPDATE SKIP LOCKED) RETURNING`, sleeping until the earliest due row or the poll interval. |
| heapq | `bench/peers/heap_engine.py`: Pulsar's in-memory tracker in Python: a heap of `(due, log offset)`, one release thread on a condition variable, bodies in an append-only log; a restart is a new process rebuilding the heap from the log. It runs inside the harness, so its lateness has no network hop. |

Workloads: **steady**: one producer paced at the rate, each message due a uniformly random delay
later; **burst**: all messages due in the same millisecond, sent as fast as 8 sender threads go
(that is the ingest rate); **horizon**: messages due uniformly over the span (RocketMQ's timer
refuses more than 3 days, delay levels stop at 2 h, so those two get fewer messages within their
limits), loaded by each system's fastest path, then memory per pending message is read and the
system is stopped gracefully with probe messages that come due while it is down and started again:
**restart → first delivery** is the time from the start command to the first probe reaching a
consumer (for timewheel, a new engine process; for RocketMQ's timer and levels, the broker; for
Redis, PostgreSQL, their servers; for heapq, a new process rebuilding from its log).

Every system and reference row that needs RocketMQ gets a local broker of its own, started fresh
for it and stopped after it (`--no-broker-per-system`: one broker for the whole run). "The same
broker" below means the same kind: a broker the intake rows left with millions of messages costs
the next system's phase a different amount of CPU than a fresh one.

Server CPU per message is the user + system CPU time of the system's own processes during the
steady phase over the messages sent (timewheel: the engine process and the broker it runs through;
RocketMQ: the broker; the servers for Redis and PostgreSQL; the in-harness heapq has none to count):
on a shared machine it is steadier than a rate.

Lateness is receive time at the consumer minus the wanted due time, on one clock (everything runs
on this machine). Memory per pending message: timewheel, RSS of an engine restarted with the pending
messages minus a fresh one's (messages due beyond the next hour stay on disk); RocketMQ, broker RSS
growth; Redis, growth of `used_memory`; PostgreSQL, RSS growth of its processes (shared buffers
touched); heapq, RSS growth of a process across its rebuild. Disk per pending message: allocated
bytes of the data directory (timewheel, Redis AOF, the broker's store), `pg_total_relation_size`
for PostgreSQL, the log for heapq.
"""


def _warm_up(doc: dict) -> str:
    """The high-rate phase's unmeasured lead, as the page says it."""
    w = doc["config"].get("steady_high_warm_up_s")
    return f"{w:g} s" if isinstance(w, (int, float)) else "no time (runs before the warm-up existed)"


def _process_label(key: str) -> str:
    """'PID name' of a CPU sample as a reader would say it."""
    name = key.split(" ", 1)[1] if " " in key else key
    if "broker" in name.lower():
        return "RocketMQ broker"
    if name.startswith("python"):
        return "timewheel engine process"
    return name


#: a plain hop (producer, broker, consumer, no delay) with a median lateness above this has stalled
PLAIN_HOP_STALL_MS = 1000.0


def plain_hop_stalled(lateness_ms: object) -> bool:
    """Whether a plain hop's lateness (p50 in ms) says its consumer stalled: a comparison with it
    would say nothing of the system beside it."""
    p50 = lateness_ms.get("p50") if isinstance(lateness_ms, dict) else None
    return isinstance(p50, (int, float)) and p50 > PLAIN_HOP_STALL_MS


def observations(doc: dict) -> str:
    """Facts read off the results that the tables alone do not make obvious."""
    c = doc["config"]
    out = []
    for phase in ("steady", "steady_high"):
        hop = doc["systems"].get("plain-hop")
        h = _get(hop, phase, "lateness_ms")
        if plain_hop_stalled(h) and isinstance(h, dict):
            out.append(f"- plain-hop, {phase}: its consumer's median lateness was {h['p50'] / 1000:,.1f} s (max "
                       f"{h.get('max', 0) / 1000:,.1f} s; the broker acknowledged "
                       f"{_num(_get(hop, phase, 'accepted'))} sends): the measuring consumer stalled "
                       "(bench/RESULTS_HOTPATHS.md, run 9, traces one such stall to the broker's log), so the "
                       "comparisons with it are left out.")
    for name, r in doc["systems"].items():
        for steady in ("steady", "steady_high"):
            rate, wanted = _get(r, steady, "producer_rate"), _get(r, steady, "rate") or c["steady_rate"]
            if isinstance(rate, (int, float)) and isinstance(wanted, int) and rate < 0.95 * wanted:
                cpu = _get(r, steady, "server_cpu_s") or {}
                spent = ", ".join(f"{_process_label(k)} {v:.0f} s" for k, v in cpu.items())
                out.append(f"- {name}: the paced producer reached only {rate:,.0f} of {wanted:,} msg/s "
                           f"(its sends waited on a saturated path), and lateness grew while it produced. CPU "
                           f"seconds spent by its processes in that phase: {spent}.")
        for phase in ("steady", "steady_high", "burst"):
            p = _get(r, phase) or {}
            if isinstance(p, dict) and "accepted" in p and p.get("received", 0) < p["accepted"]:
                out.append(f"- {name}, {phase}: {p['accepted'] - p['received']:,} of {p['accepted']:,} accepted "
                           "messages never reached the consumer.")
        over = _get(r, "burst", "ingest_overran_due_ms")
        if isinstance(over, (int, float)) and over > 0:
            out.append(f"- {name}, burst: storing the burst took {over / 1000:,.1f} s longer than the "
                       f"{c['burst_lead_s']:g} s lead, so part of its burst lateness is ingest falling behind.")
        dups = _get(r, "burst", "diagnostics", "duplicates_total")
        if isinstance(dups, (int, float)) and dups > 0:
            out.append(f"- {name}: its engine counted {dups:.0f} messages as duplicates and dropped them. They were "
                       "distinct messages: rocketmq-client-python 0.5.0rc2's native client gives concurrent sends "
                       "from several threads the same UNIQ_KEY now and then, and the engine dedupes on that id.")
        for phase in ("steady", "steady_high"):
            seen, sent = _get(r, phase, "lateness_ms", "p99"), _get(r, phase, "diagnostics",
                                                                  "engine_send_lateness_last_minute_ms") or {}
            own = sent.get("p99") if isinstance(sent, dict) else None
            if isinstance(seen, (int, float)) and isinstance(own, (int, float)) and seen > max(5 * own, own + 1000):
                out.append(f"- {name}, {phase}: the consumer measured p99 {seen:,.1f} ms while the engine's own "
                           f"send lateness over the same minute was p99 {own:,.1f} ms ({sent.get('count', 0):,.0f} "
                           "sends, as the broker acknowledged them): the delay arose after the broker stored "
                           "the messages, between it and the measuring consumer.")
        restart = _get(r, "horizon", "restart") or {}
        if isinstance(restart, dict) and restart.get("warning"):
            out.append(f"- {name}: {restart['warning']}.")
    return "\n".join(out) + "\n" if out else (
        "- None of the anomalies this report looks for: a plain-hop consumer that stalled, a producer short of "
        "its rate, accepted messages never received, a burst stored past its due time, messages an engine "
        "dropped as duplicates, lateness that arose after the broker stored a message, a restart's warning.\n")


def render(doc: dict, json_name: str, png_name: str) -> str:
    """The whole RESULTS.md."""
    c = doc["config"]
    m = doc["machine"]
    ls, le = doc["load_average_start"], doc.get("load_average_end", ["?"])
    per = "\n".join(f"- {name}: load average {_get(r, 'load_average_before')} before, "
                    f"{_get(r, 'load_average_after')} after" for name, r in doc["systems"].items())
    return f"""# timewheel against its peers

Generated by `python -m bench.peers report` from [`results/{json_name}`](results/{json_name}); do
not edit by hand. Re-run everything with the command below (needs Java 17 and Maven for the local
RocketMQ; installs `redis-server` and `postgresql` with apt-get if they are missing):

```bash
{doc['command']}
```

Scale up or narrow down with flags (`python -m bench.peers run --help`), e.g.
`--steady-rate 5000 --steady-seconds 120 --burst 100000 --horizon-messages 10000000`, or
`--system redis-zset --system timewheel`; `python -m bench.peers report` rebuilds this page and the
chart from the JSON. All systems ran one after another on the same machine; the load averages below
say how busy it was around each (the benchmark's own broker and servers included).

- date: {m['date']}
- machine: a {m['cpus']}-core machine ({m['platform']}, {m['memory_gb']} GB RAM, Python
  {m['python']}): load average (1, 5, 15 min) {ls} at the start, {le} at the end.
{per}
- workloads: steady {c['steady_rate']}/s for {c['steady_seconds']:g} s with delays
  {c['delay_min_ms']}–{c['delay_max_ms']} ms (plain hop and timewheel also {c.get('steady_high_rate', '–')}/s for
  {c.get('steady_high_seconds', '–')} s); burst {c['burst']:,} messages due in one millisecond
  (sent {c['burst_lead_s']:g} s ahead); horizon {c['horizon_messages']:,} messages over
  {c['horizon_days']:g} days ({c['horizon_broker_messages']:,} for RocketMQ's timer and levels);
  {c['probes']} restart probes; {c['body_bytes']}-byte bodies; poll interval {c['poll_ms']:g} ms for
  Redis and PostgreSQL.

## Lateness (ms unless marked s)

{lateness_table(doc)}
![lateness CDFs](results/{png_name})

## Ingest, memory, restart

{capacity_table(doc)}
## Observations

{observations(doc)}
## timewheel against the broker's own floor

Measured in the same run: the plain hop is a message produced to and consumed from the same broker
by the same producer and consumer, with no delay (lateness = receive − send); the intake ceiling is
what RocketMQ's own Java producer pushes into the broker; the no-op consumer is what RocketMQ's own Java
pull consumer reads out of it. The 1k/s rows are produced and consumed by the Python client as every
peer's are, so they compare with the peers' rows above; the 10k/s rows are produced by RocketMQ's
Java producer (small batches from 4 threads) and consumed by RocketMQ's Java push consumer (a topic
only it reads), for the plain hop and timewheel alike, since the Python producer tops out below 10k/s
here and the Python consumer saturates there, so those figures would be the harness's, not the
system's; their stream runs {_warm_up(doc)} before the measured messages, unmeasured, while the clients'
JVMs warm up. Engine CPU is the `timewheel serve` process alone over the messages sent in the phase (idle
time included); broker CPU is the broker process during the same phase; neither counts the clients.

{floor_tables(doc)}
## timewheel's figures as ratios to each peer

Each cell is peer ÷ timewheel for lateness, memory and restart time, and timewheel ÷ peer for the
ingest rate: above 1 means timewheel does better by that factor.

{ratio_table(doc)}
{_METHOD}"""


def write_report(doc: dict, stem: str = "peers", out: Path | None = None) -> tuple[Path, Path, Path]:
    """Write `results/<stem>.json`, `results/<stem>.png` and RESULTS.md (bench/'s, or under `out`, a scratch
    directory for trial runs); return their paths."""
    results, md = (RESULTS_DIR, RESULTS_MD) if out is None else (out / "results", out / "RESULTS.md")
    results.mkdir(parents=True, exist_ok=True)
    js, png = results / f"{stem}.json", results / f"{stem}.png"
    js.write_text(json.dumps(doc, indent=1) + "\n")
    chart(doc, png)
    md.write_text(render(doc, js.name, png.name))
    return js, png, md


def console(doc: dict) -> str:
    """The tables as printed at the end of a run."""
    return lateness_table(doc) + "\n" + capacity_table(doc) + "\n" + floor_tables(doc) + "\n" + ratio_table(doc)
