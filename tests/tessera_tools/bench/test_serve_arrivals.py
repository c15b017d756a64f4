"""Arrival processes of `tessera bench serve`: seeded, with the right mean
gap, and burstier (higher variance) for gamma shapes below 1."""

from __future__ import annotations

import math
import statistics

import pytest

from tessera_tools.bench.serve.arrivals import arrival_offsets, offered_rate, parse_rates


def gaps(offsets: list[float]) -> list[float]:
    return [b - a for a, b in zip(offsets, offsets[1:])]


def test_seeded_and_starting_at_zero():
    first = arrival_offsets(100, rate=4, seed=7)
    assert first == arrival_offsets(100, rate=4, seed=7)
    assert first != arrival_offsets(100, rate=4, seed=8)
    assert first[0] == 0.0 and first == sorted(first)


def test_poisson_mean_gap_is_one_over_rate():
    g = gaps(arrival_offsets(20_000, rate=5, burstiness=1.0, seed=0))
    assert statistics.mean(g) == pytest.approx(1 / 5, rel=0.03)
    # Exponential gaps: standard deviation equals the mean.
    assert statistics.stdev(g) == pytest.approx(1 / 5, rel=0.05)


def test_gamma_keeps_the_rate_and_bursts_more():
    poisson = gaps(arrival_offsets(20_000, rate=5, burstiness=1.0, seed=0))
    bursty = gaps(arrival_offsets(20_000, rate=5, burstiness=0.25, seed=0))
    even = gaps(arrival_offsets(20_000, rate=5, burstiness=4.0, seed=0))
    assert statistics.mean(bursty) == pytest.approx(1 / 5, rel=0.05)
    assert statistics.mean(even) == pytest.approx(1 / 5, rel=0.03)
    # Variance of gamma gaps is 1 / (rate^2 * burstiness): 4x Poisson's at 0.25.
    assert statistics.variance(bursty) > 2 * statistics.variance(poisson)
    assert statistics.variance(even) < statistics.variance(poisson) / 2


def test_infinite_rate_sends_everything_at_once():
    assert arrival_offsets(5, rate=math.inf) == [0.0] * 5


def test_the_offered_rate_is_the_drawn_schedules():
    offsets = arrival_offsets(50, rate=10, seed=3)
    offered = offered_rate(offsets, 10)
    assert offered == pytest.approx(49 / offsets[-1])
    assert offered != pytest.approx(10, rel=1e-3)  # a short draw strays from the nominal rate
    assert offered_rate([0.0, 0.5, 1.0], 3) == 2.0
    assert offered_rate([0.0] * 5, math.inf) is None and offered_rate([0.0], 4) is None


def test_rate_parsing():
    assert parse_rates("1, 2,4,inf") == [1, 2, 4, math.inf]
    for bad in ("0", "-1", "fast", ""):
        with pytest.raises(ValueError):
            parse_rates(bad)
    with pytest.raises(ValueError, match="burstiness"):
        arrival_offsets(3, rate=1, burstiness=0)
