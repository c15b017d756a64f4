"""Scaling signals from the engine pods' and the gateway's real metric exports."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from engine_pod.core.stats import SchedulerStats
from engine_pod.server.in_flight import InFlightSeconds
from engine_pod.server.metrics import EngineMetrics, InFlightCollector
from gateway.metrics import GatewayMetrics
from tessera_operator.signals import (
    PodSample,
    counter_increase,
    gateway_demand,
    parse_gateway_queued,
    parse_pod_metrics,
    pool_signals,
)


def engine_text(metrics: EngineMetrics) -> str:
    return generate_latest(metrics.registry).decode()


def stats(waiting: int, running: int, kv: float) -> SchedulerStats:
    s = SchedulerStats()
    s.num_waiting_reqs, s.num_running_reqs, s.kv_cache_usage = waiting, running, kv
    return s


def test_parses_the_engine_pods_export():
    m = EngineMetrics("llama")
    m.on_step(stats(waiting=3, running=5, kv=0.6))
    m.on_first_token(10, arrival=0.0, scheduled=0.1, now=0.5)
    m.on_first_token(10, arrival=0.0, scheduled=0.1, now=1.5)
    m.on_tokens(1, since_last=0.02)
    sample = parse_pod_metrics(engine_text(m))
    assert (sample.waiting, sample.running, sample.kv_usage) == (3, 5, 0.6)
    assert (sample.ttft_sum, sample.ttft_count) == (2.0, 2)
    assert (sample.itl_sum, sample.itl_count) == (pytest.approx(0.02), 1)


def test_latency_is_the_mean_over_the_last_interval():
    m = EngineMetrics("llama")
    m.on_first_token(1, arrival=0.0, scheduled=None, now=10.0)  # a slow request long ago
    first = {"pod-a": parse_pod_metrics(engine_text(m))}
    m.on_first_token(1, arrival=0.0, scheduled=None, now=0.2)
    m.on_first_token(1, arrival=0.0, scheduled=None, now=0.4)
    second = {"pod-a": parse_pod_metrics(engine_text(m))}
    assert pool_signals(second, first).ttft == pytest.approx(0.3)
    assert pool_signals(second, second).ttft is None  # nothing new: no sample


def test_pool_aggregates_and_restarted_pods():
    current = {"a": PodSample(waiting=4, running=2, kv_usage=0.5, itl_sum=1.0, itl_count=10),
               "b": PodSample(waiting=0, running=1, kv_usage=0.9, itl_sum=0.2, itl_count=2)}
    previous = {"a": PodSample(itl_sum=0.5, itl_count=5),
                "b": PodSample(itl_sum=9.0, itl_count=90)}  # b restarted: counters went down
    s = pool_signals(current, previous)
    assert s.queue == 2.0 and s.kvUsage == pytest.approx(0.7) and s.busy
    assert s.itl == pytest.approx((0.5 + 0.2) / (5 + 2))
    assert s.value("queue") == 2.0


def test_concurrency_is_requests_in_flight_per_ready_pod_gateway_queue_included():
    m = EngineMetrics("llama")
    m.on_step(stats(waiting=3, running=5, kv=0.6))  # a real export: 8 in flight on pod a
    current = {"a": parse_pod_metrics(engine_text(m)), "b": PodSample(waiting=1, running=6)}
    assert pool_signals(current, {}).concurrency == pytest.approx((8 + 7) / 2)
    s = pool_signals(current, {}, gateway_queued=5)  # held at the gateway: demand not yet on a pod
    assert s.concurrency == pytest.approx((8 + 7 + 5) / 2) and s.value("concurrency") == s.concurrency
    assert s.queue == 2.0, "the gateway's queue is not the pods' waiting queue"
    idle = pool_signals({"a": PodSample(), "b": PodSample()}, {})
    assert idle.concurrency == 0.0 and not idle.busy


def test_concurrency_is_each_pods_mean_over_the_interval():
    """Pod a held 6 requests on average over the 5 s between scrapes (30
    request-seconds) though its gauges read 1 now; pod b is new (no previous
    scrape) and pod c restarted (its counter went down): both fall back to
    their gauges."""
    previous = {"a": PodSample(in_flight_seconds=100.0, scraped_at=10.0),
                "c": PodSample(in_flight_seconds=500.0, scraped_at=10.0)}
    current = {"a": PodSample(running=1, in_flight_seconds=130.0, scraped_at=15.0),
               "b": PodSample(running=2, waiting=1, in_flight_seconds=4.0, scraped_at=15.0),
               "c": PodSample(running=2, in_flight_seconds=1.0, scraped_at=15.0)}
    assert pool_signals(current, previous).concurrency == pytest.approx((6 + 3 + 2) / 3)
    assert pool_signals(current, previous, gateway_queued=3).concurrency == pytest.approx((6 + 3 + 2 + 3) / 3)
    # A scrape without a time (or at the same time) gives no interval: the gauges again.
    assert pool_signals({"a": PodSample(running=1, in_flight_seconds=130.0)}, previous).concurrency == 1.0
    assert pool_signals({"a": PodSample(running=1, in_flight_seconds=130.0, scraped_at=10.0)},
                        previous).concurrency == 1.0


def test_the_exported_counter_is_parsed_with_the_scrape_time():
    m, now = EngineMetrics("llama"), [0.0]
    seconds = InFlightSeconds(lambda: now[0])
    m.registry.register(InFlightCollector(seconds, "llama"))
    seconds.set(2)
    now[0] = 3.0
    sample = parse_pod_metrics(engine_text(m), scraped_at=42.0)
    assert sample.in_flight_seconds == pytest.approx(6.0) and sample.scraped_at == 42.0
    assert parse_pod_metrics("").in_flight_seconds is None, "a pod without the counter"


def test_empty_pool_has_no_signal():
    s = pool_signals({}, {})
    assert (s.queue, s.ttft, s.itl, s.kvUsage, s.concurrency, s.busy) == (None, None, None, None, None, False)
    # At zero ready pods gateway demand is no signal: decide() lifts the pool from zero on it instead.
    assert pool_signals({}, {}, gateway_queued=7).concurrency is None


def test_gateway_queue_sums_priority_classes():
    g = GatewayMetrics()
    g.queue_length.labels("standard").set(3)
    g.queue_length.labels("batch").set(2)
    assert parse_gateway_queued(generate_latest(g.registry).decode()) == 5
    assert parse_gateway_queued("") == 0


def test_unplaced_prefills_are_the_rise_of_each_gateways_counter():
    a, b = GatewayMetrics(), GatewayMetrics()
    a.prefills_unplaced.inc(3)
    a.queue_length.labels("standard").set(2)

    def texts() -> dict[str, str]:
        return {"a": generate_latest(a.registry).decode(), "b": generate_latest(b.registry).decode(), "old": ""}

    demand, counters = gateway_demand(texts(), {})
    assert (demand.queued, demand.prefills_unplaced) == (2, 0), "a first scrape says nothing of this interval"
    assert counters == {"a": 3.0, "b": 0.0}, "a gateway without the counter is left out"
    a.prefills_unplaced.inc(2)
    b.prefills_unplaced.inc(1)
    demand, counters = gateway_demand(texts(), counters)
    assert demand.prefills_unplaced == 3
    assert counter_increase({"a": 1.0, "b": 1.0}, counters) == 1, "a restarted (5 -> 1): its count since"
