"""What an engine's failure costs under four designs, measured by simulating every message.

    python -m bench.ha_simulation [--rate 1000] [--trials 100] [--seed 1]

One engine accepts `rate` messages a second (Poisson arrivals), delays log-uniform from 1 s to
1 h, for an hour before it fails, so its schedule is in steady state. Each trial fails it at a
random instant and counts, per design, messages lost, messages delivered twice, and how late the
messages due around the failure were (the recovery time seen by consumers):

- none: the engine and its disk are gone for good (what scale-out alone gives today);
- restart: the same data directory is served again after an outage (a supervisor restart, or the
  disk attached to another host);
- async_replica: the data directory is replicated asynchronously to a standby disk, which is
  served after the failure is detected;
- standby_lease (recommended, docs/HA.md): a standby consumes the delay topic under its own group
  and keeps its own copy of the schedule; it dispatches only once the active engine's fenced lease
  has expired, from the dispatch watermark the active engine published with each renewal. The
  zombie variant pauses the active engine past its lease instead of killing it, with and without
  the self-fencing check before each send.

Timings that the project measures elsewhere are read from bench/results/ (engine lateness,
restart-to-first-dispatch); the others are parameters, printed with the results.
Writes bench/results/ha_simulation.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from bench.engine_latency import _machine

RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Params:
    """Timings of the model, in seconds; measured ones are filled from bench/results/."""

    rate: float = 1000.0  # messages accepted (and, in steady state, due) per second by the failed engine
    min_delay: float = 1.0
    max_delay: float = 3600.0
    lateness_p50: float = 0.0013  # engine lateness, lognormal through p50 and p99
    lateness_p99: float = 0.027
    unrecorded: float = 0.010  # a send not yet in the dispatch log (one batch's round trip)
    restart: float = 0.27  # restart to first dispatch
    supervisor: float = 5.0  # until a supervisor has restarted the process
    detect: float = 10.0  # until a failed host is declared dead (a lease, a health check)
    replication_lag: float = 1.0  # async replication of the data directory
    lease_ttl: float = 10.0
    lease_renew: float = 10.0 / 3
    drift_margin: float = 0.5  # the standby waits this long past expiry; the active stops this long before
    lease_poll: float = 0.5
    watermark_every: float = 10.0 / 3  # published with each renewal
    zombie_pause: float = 30.0  # a pause longer than the lease (GC, VM freeze, partition)
    send_batch_s: float = 0.02  # a batch in flight when the pause starts


def _measured(p: Params) -> tuple[Params, dict[str, str]]:
    """Replace modelled timings with figures measured by the project's other benchmarks."""
    src: dict[str, str] = {}
    lat, rst = RESULTS / "engine_lateness.json", RESULTS / "engine_restart.json"
    if lat.exists():
        run = min(json.loads(lat.read_text())["runs"], key=lambda r: abs(r["rate"] - p.rate))
        p = Params(**{**asdict(p), "lateness_p50": run["lateness_ms"]["p50"] / 1000,
                      "lateness_p99": run["lateness_ms"]["p99"] / 1000})
        src["lateness"] = f"{lat.name} at {run['rate']}/s"
    if rst.exists():
        p = Params(**{**asdict(p), "restart": json.loads(rst.read_text())["run"]["restart_to_first_dispatch_ms"] / 1000})
        src["restart"] = rst.name
    return p, src


def _schedule(p: Params, rng: np.random.Generator, horizon: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Arrival, due and (undisturbed) delivery times of every message, sorted by arrival."""
    n = rng.poisson(p.rate * horizon)
    arrival = np.sort(rng.uniform(0, horizon, n))
    delay = np.exp(rng.uniform(np.log(p.min_delay), np.log(p.max_delay), n))
    sigma = (np.log(p.lateness_p99) - np.log(p.lateness_p50)) / 2.326
    late = np.exp(rng.normal(np.log(p.lateness_p50), sigma, n))
    due = arrival + delay
    return arrival, due, due + late


def _trial(p: Params, arrival: np.ndarray, due: np.ndarray, sent: np.ndarray, t_f: float,
           rng: np.random.Generator) -> dict[str, dict[str, float]]:
    """Lost, duplicated and late messages of each design for a failure at t_f."""
    # only messages accepted by t_f and not delivered a minute before it can be affected
    near = (arrival <= t_f) & (sent > t_f - 60)
    arrival, due, sent = arrival[near], due[near], sent[near]
    accepted = np.ones(len(arrival), bool)
    pending = accepted & (sent > t_f)  # accepted, not delivered when the engine fails
    in_doubt = accepted & (sent <= t_f) & (sent + p.unrecorded > t_f)  # sent, not yet recorded
    out: dict[str, dict[str, float]] = {}

    def account(name: str, lost: np.ndarray, dup: np.ndarray, resume: float) -> None:
        # messages due while nobody dispatched are sent at `resume`, oldest first
        waiting = pending & ~lost & (due < resume)
        extra = resume - due[waiting]
        out[name] = {"lost": int(lost.sum()), "duplicates": int(dup.sum()), "late": int(waiting.sum()),
                     "max_late_s": float(extra.max()) if len(extra) else float(resume - t_f)}

    none = np.zeros_like(pending)
    account("none", pending, none, np.inf)
    account("restart_supervised", none, in_doubt, t_f + p.supervisor + p.restart)
    account("restart_new_host", none, in_doubt, t_f + p.detect + p.restart)
    # the replica misses what arrived (and what was recorded) in the last replication_lag
    unreplicated = pending & (arrival > t_f - p.replication_lag)
    resent = accepted & (sent <= t_f) & (sent + p.unrecorded > t_f - p.replication_lag)
    account("async_replica", unreplicated, resent, t_f + p.detect + p.restart)
    # standby: the lease was last renewed at a random phase before the failure; the watermark is
    # what had been recorded by the last renewal, minus anything still unrecorded then
    phase = rng.uniform(0, p.lease_renew)
    renewed = t_f - phase
    w_at = t_f - rng.uniform(0, p.watermark_every) if p.watermark_every != p.lease_renew else renewed
    unrec = (due <= w_at) & (sent + p.unrecorded > w_at)
    watermark = min(w_at, float(due[unrec].min())) if unrec.any() else w_at
    takeover = renewed + p.lease_ttl + p.drift_margin + rng.uniform(0, p.lease_poll)
    replay = accepted & (due > watermark) & (sent <= t_f)  # delivered by the active, sent again
    account("standby_lease", none, replay, takeover)
    # zombie: paused at t_f, resumes at t_f + pause and sends what came due meanwhile
    resumes = t_f + p.zombie_pause
    fenced = accepted & (sent <= t_f) & (sent > t_f - p.send_batch_s)  # the batch in flight
    account("standby_lease_zombie_fenced", none, replay | fenced, takeover)
    double = pending & (due < resumes)
    account("standby_lease_zombie_unfenced", none, replay | double, takeover)
    return out


def simulate(p: Params, trials: int, seed: int) -> dict[str, dict[str, float | None]]:
    """Summaries over `trials` failure instants in the second hour."""
    rng = np.random.default_rng(seed)
    horizon = p.max_delay + 120
    arrival, due, sent = _schedule(p, rng, horizon)
    rows = [_trial(p, arrival, due, sent, float(rng.uniform(p.max_delay, p.max_delay + 60)), rng)
            for _ in range(trials)]
    summary: dict[str, dict[str, float | None]] = {}  # no recovery time where some trial never recovered
    for design in rows[0]:
        col = {k: np.array([r[design][k] for r in rows]) for k in rows[0][design]}
        summary[design] = {
            "lost_mean": round(float(col["lost"].mean())), "lost_max": int(col["lost"].max()),
            "duplicates_mean": round(float(col["duplicates"].mean()), 1), "duplicates_max": int(col["duplicates"].max()),
            "late_mean": round(float(col["late"].mean())),
            "rto_s_p50": round(float(np.median(col["max_late_s"])), 2) if np.isfinite(col["max_late_s"]).all() else None,
            "rto_s_max": round(float(col["max_late_s"].max()), 2) if np.isfinite(col["max_late_s"]).all() else None,
        }
    return summary


def main(argv: Sequence[str] | None = None) -> None:
    """Run the default case and a lease-TTL sweep; print and write bench/results/ha_simulation.json."""
    ap = argparse.ArgumentParser(prog="python -m bench.ha_simulation", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--trials", type=int, default=50)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    base, sources = _measured(Params(rate=args.rate))
    out: dict[str, object] = {"machine": _machine(),
                              "command": " ".join(["python -m bench.ha_simulation",
                                                   *(sys.argv[1:] if argv is None else argv)]),
                              "params": asdict(base), "measured_inputs": sources,
                              "designs": simulate(base, args.trials, args.seed), "lease_sweep": {}}
    for ttl in (3.0, 10.0, 30.0):
        p = Params(**{**asdict(base), "lease_ttl": ttl, "lease_renew": ttl / 3, "watermark_every": ttl / 3})
        out["lease_sweep"][f"ttl_{ttl:g}s"] = simulate(p, args.trials, args.seed)["standby_lease"]  # type: ignore[index]
    for w in (0.1, 1.0):  # a watermark published more often than the lease is renewed
        p = Params(**{**asdict(base), "watermark_every": w})
        out["lease_sweep"][f"ttl_10s_watermark_{w:g}s"] = simulate(p, args.trials, args.seed)["standby_lease"]  # type: ignore[index]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ha_simulation.json").write_text(json.dumps(out, indent=2) + "\n")
    print(markdown(out))


def markdown(out: dict[str, object]) -> str:
    """The results as the table docs/HA.md quotes."""
    rows = ["| design | lost (mean) | duplicates (mean / max) | late (mean) | recovery s (p50 / max) |",
            "| --- | ---: | ---: | ---: | ---: |"]
    for group in ("designs", "lease_sweep"):
        for name, r in out[group].items():  # type: ignore[attr-defined]
            label = name if group == "designs" else f"standby_lease {name}"
            rto = "never" if r["rto_s_max"] is None else f"{r['rto_s_p50']} / {r['rto_s_max']}"
            rows.append(f"| {label} | {r['lost_mean']} | {r['duplicates_mean']} / {r['duplicates_max']} | "
                        f"{r['late_mean']} | {rto} |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
