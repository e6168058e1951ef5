"""95% intervals for the evaluations' numbers: accuracies (proportions) and oracle recovery (a ratio of differences).

    wilson_interval(k, n) -> (lo, hi)      Wilson score interval of a proportion k / n
    recovery(router, base, oracle) -> float                (router - base) / (oracle - base), on accuracies
    recovery_interval(router_hits, base_hits, oracle_hits) -> (lo, hi)
                                           paired percentile bootstrap over items, fixed seed (reproducible)

Wilson rather than the normal ("Wald") interval because it stays inside [0, 1] and keeps its coverage at 0 / n and
n / n, which our rows reach (the base answers no mixed request). Recovery is a ratio of differences of accuracies
measured on the SAME items, so its three terms are correlated; the bootstrap resamples items (every row's hit of an
item travels together) and reads the 2.5th and 97.5th percentiles of the resampled ratios. A resample whose
denominator is not positive (the oracle no better than the base) has no ratio and is dropped; the interval is
None when more than half are.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

Z95 = 1.959963984540054  # the standard normal's 97.5th percentile (scipy.stats.norm.ppf(0.975))
BOOTSTRAP_SEED = 0
BOOTSTRAP_RESAMPLES = 2000


def wilson_interval(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of the proportion k / n: (centre -/+ half) with
    centre = (p + z²/2n) / (1 + z²/n), half = z sqrt(p(1-p)/n + z²/4n²) / (1 + z²/n). n = 0: (0, 1)."""
    if not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return 0.0, 1.0
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def recovery(router: float, base: float, oracle: float) -> float | None:
    """Share of the oracle's gain over the base that the router recovers; None when the oracle gains nothing."""
    return None if oracle <= base else (router - base) / (oracle - base)


def recovery_interval(router_hits: Sequence[bool], base_hits: Sequence[bool], oracle_hits: Sequence[bool], *,
                      resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED, level: float = 0.95
                      ) -> tuple[float, float] | None:
    """Paired percentile bootstrap interval of recovery(mean router, mean base, mean oracle) over items: each
    resample draws len(items) items with replacement and takes all three rows' hits of each drawn item."""
    hits = np.asarray([router_hits, base_hits, oracle_hits], dtype=np.float64)  # [3, n]
    if hits.ndim != 2 or hits.shape[1] == 0:
        raise ValueError("recovery_interval needs three equally long, non-empty hit lists (one per item)")
    n = hits.shape[1]
    rng = np.random.default_rng(seed)
    means = np.empty((3, resamples))
    for start in range(0, resamples, 500):  # [500, n] indices at a time: bounded memory at n = 10,000s
        idx = rng.integers(0, n, size=(min(500, resamples - start), n))
        means[:, start:start + idx.shape[0]] = hits[:, idx].mean(axis=2)
    router, base, oracle = means
    gain = oracle - base
    ok = gain > 0
    if ok.sum() * 2 < resamples:
        return None
    ratios = (router[ok] - base[ok]) / gain[ok]
    tail = (1 - level) / 2 * 100
    lo, hi = np.percentile(ratios, [tail, 100 - tail])
    return float(lo), float(hi)


__all__ = ["BOOTSTRAP_RESAMPLES", "BOOTSTRAP_SEED", "Z95", "recovery", "recovery_interval", "wilson_interval"]
