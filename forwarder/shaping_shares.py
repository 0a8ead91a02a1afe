"""How traffic shaping divides a rate: weighted water-filling within caps, rounded to whole messages.

Pure functions over mappings, so the shaper's arithmetic is tested apart from its state and lock.
"""
from __future__ import annotations

import math
from typing import Hashable, Mapping, TypeVar

__all__ = ["EPS", "class_shares", "fair_split"]

EPS = 1e-6  # float slack: a bucket at 0.9999999 tokens holds one
_CREDIT_BOUND = 2.0
K = TypeVar("K", bound=Hashable)


def _water_fill(total: float, caps: Mapping[K, int], weights: Mapping[K, float]) -> dict[K, float]:
    """Share `total` (<= sum of caps) by weight, none above its cap, the excess to the others."""
    out: dict[K, float] = {}
    order = sorted(caps, key=lambda k: caps[k] / weights[k])
    remaining, wsum = float(total), sum(weights[k] for k in caps)
    for i, k in enumerate(order):
        level = remaining / wsum if wsum > 0 else 0.0
        if caps[k] <= level * weights[k] + 1e-12:
            out[k] = float(caps[k])
            remaining -= caps[k]
            wsum -= weights[k]
            continue
        for rest in order[i:]:
            out[rest] = level * weights[rest]
        break
    return out


def fair_split(total: int, caps: Mapping[K, int], weights: Mapping[K, float], credit: dict[K, float]) -> dict[K, int]:
    """Whole shares of `total` by weight within caps; `credit` carries each key's rounding remainder
    between calls (updated in place) so that repeated small splits add up to the exact shares."""
    fluid = _water_fill(total, caps, weights)
    want = {k: fluid[k] + credit.get(k, 0.0) for k in caps}
    got = {k: max(0, min(caps[k], math.floor(want[k] + EPS))) for k in caps}
    rest = total - sum(got.values())
    while rest > 0:  # one more each for the largest remainders, round after round
        open_keys = sorted((k for k in caps if got[k] < caps[k]), key=lambda k: got[k] - want[k])[:rest]
        if not open_keys:
            break
        for k in open_keys:
            got[k] += 1
        rest -= len(open_keys)
    while rest < 0:  # carried credit over-asked: one less each for the smallest remainders
        full_keys = sorted((k for k in caps if got[k] > 0), key=lambda k: want[k] - got[k])[:-rest]
        if not full_keys:
            break
        for k in full_keys:
            got[k] -= 1
        rest += len(full_keys)
    for k in caps:
        credit[k] = max(-_CREDIT_BOUND, min(_CREDIT_BOUND, want[k] - got[k]))
    return got


def class_shares(weights: Mapping[str, float], min_shares: Mapping[str, float]) -> dict[str, float]:
    """Each busy class's share of the global rate: by weight, raised to its min_share where the
    weight gives less (the others then share what is left by weight)."""
    fixed: dict[str, float] = {}
    free = list(weights)
    while free:
        room = max(0.0, 1.0 - sum(fixed.values()))
        wsum = sum(weights[c] for c in free)
        low = [c for c in free if room * weights[c] / wsum < min_shares.get(c, 0.0) - 1e-12]
        if not low:
            return {**fixed, **{c: room * weights[c] / wsum for c in free}}
        for c in low:
            fixed[c] = min_shares[c]
        free = [c for c in free if c not in fixed]
    return fixed
