"""InFlightSeconds: the integral of a pod's request count over time."""

from __future__ import annotations

import pytest

from engine_pod.server.in_flight import InFlightSeconds
from engine_pod.server.metrics import InFlightCollector
from tests.fake_clock import FakeClock


def test_total_is_the_area_under_the_count():
    clock = FakeClock(100.0)
    seconds = InFlightSeconds(clock)
    clock.now += 5.0               # idle: nothing accrues
    seconds.set(2)
    clock.now += 1.5               # 2 requests for 1.5 s
    assert seconds.total() == pytest.approx(3.0), "read between changes: counts up to now"
    seconds.set(5)
    clock.now += 0.5               # 5 for 0.5 s
    seconds.set(0)
    clock.now += 10.0              # idle again
    assert seconds.total() == pytest.approx(3.0 + 2.5)


def test_rate_between_two_reads_is_the_mean_concurrency():
    clock = FakeClock(100.0)
    seconds = InFlightSeconds(clock)
    seconds.set(8)
    first = seconds.total()
    clock.now += 1.0
    seconds.set(2)                 # 8 for 1 s, then 2 for 3 s: a mean of 3.5 over 4 s,
    clock.now += 3.0               # where a gauge read at the end says 2
    assert (seconds.total() - first) / 4.0 == pytest.approx(3.5)


def test_exported_as_a_counter():
    clock = FakeClock(100.0)
    seconds = InFlightSeconds(clock)
    seconds.set(3)
    clock.now += 2.0
    [family] = InFlightCollector(seconds, "llama").collect()
    [sample] = family.samples
    assert family.type == "counter" and sample.name == "tessera_request_in_flight_seconds_total"
    assert sample.labels == {"model_name": "llama"} and sample.value == pytest.approx(6.0)
