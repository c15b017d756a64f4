"""How the benchmarks turn samples into figures: one percentile definition
for all of them, and best-of-N timing."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (q in [0, 100]) by linear interpolation between the
    two nearest ranks: numpy's default, and what `vllm bench serve` reports,
    so p50 is the median. NaN when there are no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q!r}: must be between 0 and 100")
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = q / 100 * (len(ordered) - 1)
    below = math.floor(rank)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (rank - below)


def best_of(fn: Callable[[], object], repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls, after one untimed call
    (first-call costs: allocations, caches, lazy setup)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    fn()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best
