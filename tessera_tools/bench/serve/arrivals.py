"""When requests arrive: a seeded Poisson or gamma process, as `vllm bench serve`.

Inter-arrival gaps are gamma-distributed with shape = burstiness and scale =
1 / (rate * burstiness), so the mean gap is 1 / rate whatever the burstiness.
Burstiness 1 is the exponential distribution (a Poisson process); below 1 the
gaps vary more (bursts and lulls), above 1 they are more even.
"""

from __future__ import annotations

import math
import random


def parse_rate(text: str) -> float:
    """A request rate in requests/s: a positive number or "inf" (all at once)."""
    try:
        rate = float(text)
    except ValueError:
        raise ValueError(f"request rate {text!r} is not a number (or 'inf')") from None
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 (or 'inf'), got {text!r}")
    return rate


def parse_rates(text: str) -> list[float]:
    """A comma-separated sweep, e.g. "1,2,4,inf"."""
    rates = [parse_rate(part.strip()) for part in text.split(",") if part.strip()]
    if not rates:
        raise ValueError("give at least one request rate")
    return rates


def arrival_offsets(num_requests: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds from the start of the run at which each request is sent. The
    first goes at 0; an infinite rate sends them all at 0."""
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)
    offsets, clock = [], 0.0
    for _ in range(num_requests):
        offsets.append(clock)
        clock += rng.gammavariate(burstiness, scale)
    return offsets


def offered_rate(offsets: list[float], rate: float) -> float | None:
    """The rate the drawn arrivals actually offer: gaps per second between the first and the last.
    A finite Poisson draw strays from its nominal rate (about 1/sqrt(n)), so whether a server kept
    up is judged against this; None for an infinite rate or fewer than two arrivals."""
    span = offsets[-1] - offsets[0] if offsets else 0.0
    if math.isinf(rate) or span <= 0:
        return None
    return (len(offsets) - 1) / span
