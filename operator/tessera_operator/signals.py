"""From Prometheus text (engine pods' and gateway's /metrics) to each pool's scaling signals.

Latency signals are means over the last interval: the difference of the
histograms' _sum and _count between two scrapes, summed over the pool's
ready pods. A pod seen for the first time, or whose counters went down
(it restarted), contributes its whole history since start.

Concurrency is the load signal proper: requests in flight per ready pod
(on the pods, plus those the gateway still holds), which by Little's law
(in flight = arrival rate x time in system) grows in proportion to the
load, where an engine's waiting queue stays near 0 while it admits requests
into its batch. A pod's part is its mean over the interval (the rate of its
request-seconds counter between the two scrapes); only a pod without a
previous scrape (new, or restarted) falls back to its running and waiting
gauges, sampled at one instant.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# Names exported by engine_pod/server/metrics.py.
WAITING = "tessera_num_requests_waiting"
RUNNING = "tessera_num_requests_running"
KV_USAGE = "tessera_kv_cache_usage_perc"
TTFT = "tessera_time_to_first_token_seconds"
ITL = "tessera_inter_token_latency_seconds"
IN_FLIGHT_SECONDS = "tessera_request_in_flight_seconds_total"
# Gauge of gateway/metrics.py: requests waiting in its admission queue (one series per priority class).
GATEWAY_QUEUED = "tessera_gateway_queue_length"
# Counter of gateway/metrics.py: prompts a decode pod prefilled for want of a prefill pod.
GATEWAY_PREFILLS_UNPLACED = "tessera_gateway_prefills_unplaced_total"


@dataclass(frozen=True)
class PodSample:
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    itl_sum: float = 0.0
    itl_count: float = 0.0
    in_flight_seconds: float | None = None
    """The pod's request-seconds counter; None from a pod that does not export it."""
    scraped_at: float | None = None
    """When the scraper read it (its own monotonic clock): the counter's rate needs the interval."""


@dataclass(frozen=True)
class PoolSignals:
    queue: float | None      # waiting requests per ready pod
    ttft: float | None       # mean TTFT over the interval (s)
    itl: float | None        # mean inter-token latency over the interval (s)
    kvUsage: float | None    # noqa: N815 - named as the CRD's signal
    concurrency: float | None  # requests in flight (each pod's interval mean + gateway-queued) per ready pod
    busy: bool

    def value(self, signal: str) -> float | None:
        return getattr(self, signal)


def _samples(text: str):
    for family in text_string_to_metric_families(text):
        yield from family.samples


def parse_pod_metrics(text: str, scraped_at: float | None = None) -> PodSample:
    values: dict[str, float] = {}
    for s in _samples(text):
        # One model per pod: sum over label sets to stay robust to extra labels.
        values[s.name] = values.get(s.name, 0.0) + s.value
    return PodSample(
        waiting=values.get(WAITING, 0.0), running=values.get(RUNNING, 0.0), kv_usage=values.get(KV_USAGE, 0.0),
        ttft_sum=values.get(f"{TTFT}_sum", 0.0), ttft_count=values.get(f"{TTFT}_count", 0.0),
        itl_sum=values.get(f"{ITL}_sum", 0.0), itl_count=values.get(f"{ITL}_count", 0.0),
        in_flight_seconds=values.get(IN_FLIGHT_SECONDS), scraped_at=scraped_at,
    )


@dataclass(frozen=True)
class GatewayDemand:
    """What the gateways' metrics show of demand that the pools' own metrics cannot."""

    queued: int = 0
    """Requests in the gateways' admission queues, summed over the replicas."""
    prefills_unplaced: int = 0
    """Prompts the gateways had a decode pod prefill since the previous scrape, for want of a
    prefill pod (a prefill pool at zero: nothing queues while the decode pods serve)."""

    def unplaced_for(self, role: str) -> int:
        """`prefills_unplaced` as the demand of the pool of `role`: the prefill pool's alone."""
        return self.prefills_unplaced if role == "prefill" else 0


def _parse_gateway(text: str) -> tuple[int, float | None]:
    """One gateway pod's queued requests (all priority classes) and its unplaced-prefills counter
    (None from a gateway that does not export it)."""
    queued, unplaced = 0.0, None
    for s in _samples(text):
        if s.name == GATEWAY_QUEUED:
            queued += s.value
        elif s.name == GATEWAY_PREFILLS_UNPLACED:
            unplaced = (unplaced or 0.0) + s.value
    return int(queued), unplaced


def parse_gateway_queued(text: str) -> int:
    """Requests one gateway pod holds in its admission queue (all priority classes)."""
    return _parse_gateway(text)[0]


def gateway_demand(texts: dict[str, str], previous: dict[str, float]) -> tuple[GatewayDemand, dict[str, float]]:
    """This scrape's demand from each gateway pod's metrics text ({pod: text}), given the counters
    of the previous scrape; and this scrape's counters, to pass as `previous` next time."""
    parsed = {pod: _parse_gateway(text) for pod, text in texts.items()}
    counters = {pod: unplaced for pod, (_, unplaced) in parsed.items() if unplaced is not None}
    queued = sum(q for q, _ in parsed.values())
    return GatewayDemand(queued, counter_increase(counters, previous)), counters


def counter_increase(current: dict[str, float], previous: dict[str, float]) -> int:
    """How much per-pod counters rose since the previous scrape, summed. A pod seen for the first
    time adds nothing (its count so far says nothing about this interval; the operator may have
    just started), one whose counter went down (it restarted) adds its count since."""
    rise = 0.0
    for pod, value in current.items():
        before = previous.get(pod)
        if before is not None:
            rise += value - before if value >= before else value
    return int(rise)


def _delta(cur_sum: float, cur_count: float, prev: PodSample | None, which: str) -> tuple[float, float]:
    if prev is None:
        return cur_sum, cur_count
    prev_sum, prev_count = getattr(prev, f"{which}_sum"), getattr(prev, f"{which}_count")
    if cur_count < prev_count:  # the pod restarted: its counters began again
        return cur_sum, cur_count
    return cur_sum - prev_sum, cur_count - prev_count


def _mean_in_flight(sample: PodSample, prev: PodSample | None) -> float:
    """The pod's mean concurrency since its previous scrape, or its gauges now
    when there is no interval to take a rate over."""
    if (prev is not None and sample.in_flight_seconds is not None and prev.in_flight_seconds is not None
            and sample.scraped_at is not None and prev.scraped_at is not None
            and sample.scraped_at > prev.scraped_at and sample.in_flight_seconds >= prev.in_flight_seconds):
        return (sample.in_flight_seconds - prev.in_flight_seconds) / (sample.scraped_at - prev.scraped_at)
    return sample.running + sample.waiting


def _interval_mean(current: dict[str, PodSample], previous: dict[str, PodSample], which: str) -> float | None:
    total_sum = total_count = 0.0
    for pod, sample in current.items():
        d_sum, d_count = _delta(getattr(sample, f"{which}_sum"), getattr(sample, f"{which}_count"),
                                previous.get(pod), which)
        total_sum, total_count = total_sum + d_sum, total_count + d_count
    return total_sum / total_count if total_count > 0 else None


def pool_signals(current: dict[str, PodSample], previous: dict[str, PodSample],
                 gateway_queued: int = 0) -> PoolSignals:
    """Signals of a pool from its ready pods' samples (keyed by pod name) now and one interval ago.

    `gateway_queued`: requests the gateways hold in their admission queues (parse_gateway_queued,
    summed over replicas). They are demand on this pool not yet on its pods, so concurrency counts
    them; at zero ready pods every signal is None and only `decide()`'s scale from zero uses them.
    """
    if not current:
        return PoolSignals(queue=None, ttft=None, itl=None, kvUsage=None, concurrency=None, busy=False)
    n = len(current)
    in_flight = sum(_mean_in_flight(s, previous.get(pod)) for pod, s in current.items()) + gateway_queued
    return PoolSignals(
        queue=sum(s.waiting for s in current.values()) / n,
        ttft=_interval_mean(current, previous, "ttft"),
        itl=_interval_mean(current, previous, "itl"),
        kvUsage=sum(s.kv_usage for s in current.values()) / n,
        concurrency=in_flight / n,
        busy=any(s.waiting + s.running > 0 for s in current.values()),
    )
