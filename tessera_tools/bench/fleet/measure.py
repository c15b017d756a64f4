"""What a run measures outside its client: the gateways' and pods'
Prometheus counters and their processes' CPU time, read before and after
the trace (a snapshot is a flat dict of floats; a run's figure is the
difference).

Sources:
- hit rate: the gateways' tessera_gateway_cached_prompt_tokens_total /
  tessera_gateway_prompt_tokens_total, which sum the `usage` of every
  response (prompt_tokens_details.cached_tokens / prompt_tokens); the
  pods' tessera_prefix_cache_hits_total / _queries_total as a cross-check.
- prefix-query RPCs: tessera_gateway_prefix_queries_total, by outcome.
- CPU: utime + stime of /proc/<pid>/stat (every thread of the process).
- gateway-added latency: the gateways' GATEWAY_ADDED_LATENCY_METRIC histogram
  (arrival to the first engine call sent, less the admission queue wait);
  beside it, the mean of the gateway's TTFT minus the pods' TTFT.
"""

from __future__ import annotations

import math
import os
import time
import urllib.request
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from prometheus_client.parser import text_string_to_metric_families

# The histogram the gateway-added latency percentiles need: per request,
# arrival at the gateway -> the engine call sent to the chosen pod (auth,
# tokenization, admission, routing with its prefix queries). Not exposed by
# the gateway yet.
GATEWAY_ADDED_LATENCY_METRIC = "tessera_gateway_dispatch_seconds"

# Sample name -> snapshot key; "key/label" splits the key by that label's value.
GATEWAY_SAMPLES = {
    "tessera_gateway_prompt_tokens_total": "prompt_tokens",
    "tessera_gateway_cached_prompt_tokens_total": "cached_tokens",
    "tessera_gateway_routed_prefix_hit_tokens_total": "routed_hit_tokens",
    "tessera_gateway_prefix_queries_total": "prefix_queries/outcome",
    "tessera_gateway_time_to_first_token_seconds_sum": "gateway_ttft_sum",
    "tessera_gateway_time_to_first_token_seconds_count": "gateway_ttft_count",
    f"{GATEWAY_ADDED_LATENCY_METRIC}_bucket": "added_latency_bucket/le",
}
POD_SAMPLES = {
    "tessera_prefix_cache_hits_total": "pod_hit_tokens",
    "tessera_prefix_cache_queries_total": "pod_query_tokens",
    "tessera_time_to_first_token_seconds_sum": "pod_ttft_sum",
    "tessera_time_to_first_token_seconds_count": "pod_ttft_count",
}
SCRAPE_THREADS = 16


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process, all its threads."""
    with open(f"/proc/{pid}/stat") as f:
        text = f.read()
    fields = text[text.rindex(")") + 2:].split()  # after "(comm)", which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def scrape(url: str, wanted: dict[str, str]) -> dict[str, float]:
    """The wanted samples of one /metrics page, summed per snapshot key."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = wanted.get(sample.name)
            if key is None:
                continue
            base, _, label = key.partition("/")
            if label:
                key = f"{base}/{sample.labels.get(label, '')}"
            out[key] = out.get(key, 0.0) + sample.value
    return out


def _merge(parts: Iterable[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for part in parts:
        for key, value in part.items():
            total[key] = total.get(key, 0.0) + value
    return total


def snapshot(gateway_urls: list[str], pod_urls: list[str], gateway_pids: list[int],
             pod_pids: list[int]) -> dict[str, float]:
    """Every counter the run reports, and the CPU seconds so far: the
    gateways', the pods' processes' and this process's (the client)."""
    snap = {"gateway_cpu_s": sum(cpu_seconds(p) for p in gateway_pids),
            "pods_cpu_s": sum(cpu_seconds(p) for p in pod_pids),
            "client_cpu_s": time.process_time()}
    with ThreadPoolExecutor(SCRAPE_THREADS) as pool:
        gateways = list(pool.map(lambda u: scrape(u, GATEWAY_SAMPLES), gateway_urls))
        pods = list(pool.map(lambda u: scrape(u, POD_SAMPLES), pod_urls))
    return {**snap, **_merge(gateways), **_merge(pods)}


def difference(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def histogram_quantile(buckets: dict[str, float], q: float) -> float | None:
    """Prometheus's histogram_quantile over {le: cumulative count}: linear
    within the bucket the rank falls in; None without observations."""
    ordered = sorted((float(le), count) for le, count in buckets.items())
    if not ordered or ordered[-1][1] <= 0:
        return None
    rank = q * ordered[-1][1]
    lower_le, lower_count = 0.0, 0.0
    for le, count in ordered:
        if count >= rank:
            if math.isinf(le):
                return lower_le
            if count == lower_count:
                return le
            return lower_le + (le - lower_le) * (rank - lower_count) / (count - lower_count)
        lower_le, lower_count = le, count
    return ordered[-1][0]


def buckets_of(delta: dict[str, float], prefix: str) -> dict[str, float]:
    """{le: count} of the snapshot keys "prefix/le"."""
    return {key.partition("/")[2]: value for key, value in delta.items() if key.startswith(prefix + "/")}
