"""The KV store of a disaggregated fleet run: one private redis-server that
the prefill pods write their prompts' KV to and the decode pods load it from
(engine_pod/sim/kv_transfer.py: real codec, MAC and Redis, filler payload),
started for one fleet's run and stopped after it, so neither fleet of a
comparison finds the other's blocks. Also each pod's flags for its pool, and
what the run moved through the store, read from Redis, the pods and the
gateways (docs/fleet-bench.md)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kv_store.local_redis import RedisServer

# Redis INFO stats of the report: reads that found a block or not, and blocks Redis dropped.
REDIS_STATS = ("keyspace_hits", "keyspace_misses", "evicted_keys", "expired_keys")
# A pool's KV-store counters in the report: (metric sample, labels it must carry), summed over pods.
KV_COUNTERS = {
    "redis_hits": ("tessera_kv_store_hits_total", {"tier": "redis"}),
    "redis_read_bytes": ("tessera_kv_store_read_bytes_total", {"tier": "redis"}),
    "redis_written_bytes": ("tessera_kv_store_written_bytes_total", {"tier": "redis"}),
    "rejected_values": ("tessera_kv_store_rejected_values_total", {}),
}
# The gateways' engine calls by kind (gateway/metrics.py): route, retry, prefill, decode.
ROUTING = "tessera_gateway_routing_decisions_total"


@contextlib.contextmanager
def shared_store(run_dir: Path, needed: bool) -> Iterator[RedisServer | None]:
    """A fresh redis-server in `run_dir` while the block runs (None when no pool needs one)."""
    if not needed:
        yield None
        return
    server = RedisServer(run_dir)
    try:
        yield server
    finally:
        server.stop()


def pod_args(role: str, redis_url: str | None) -> list[str]:
    """A pod's flags for its pool. The private server's URL carries no password, so it may go on the
    command line (a real deployment's comes by environment)."""
    if role == "mixed":
        return []
    if redis_url is None:
        raise ValueError(f"a {role} pod needs the shared KV store")
    return ["--role", role, "--kv-redis-url", redis_url]


def redis_figures(server: RedisServer) -> dict:
    info = server.client.info()
    return {"keys": server.client.dbsize(), "used_memory_peak_bytes": info["used_memory_peak"],
            **{stat: info[stat] for stat in REDIS_STATS}}


def _sum_samples(texts: list[str], name: str, labels: dict[str, str] | None = None,
                 by: str | None = None) -> dict[str, float]:
    """Samples `name` carrying `labels`, summed over every text ({"": total}, or per value of label `by`)."""
    sums: dict[str, float] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                    key = s.labels.get(by, "") if by else ""
                    sums[key] = sums.get(key, 0.0) + s.value
    return sums


def kv_store_counters(texts: list[str]) -> dict:
    """A pool's KV-store counters (KV_COUNTERS) over the /metrics texts of its pods."""
    return {figure: _sum_samples(texts, name, labels).get("", 0.0) for figure, (name, labels) in KV_COUNTERS.items()}


def routing_by_kind(texts: list[str]) -> dict[str, float]:
    """The gateways' engine calls by kind: `prefill` calls put a prompt's KV in the store, `decode` calls
    follow one, `route` calls went without (a short uncached part, or no prefill pod listed)."""
    return _sum_samples(texts, ROUTING, by="kind")
