"""One autoscaler tick's look at the cluster: pods of each pool, their metrics, the gateway's queue."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from tessera_operator import names, pods, signals
from tessera_operator.autoscale import PoolObservation
from tessera_operator.engine_pool import METRICS_PORT
from tessera_operator.gateway import METRICS_PORT as GATEWAY_METRICS_PORT
from tessera_operator.kube import ClusterApi
from tessera_operator.names import Owner

logger = logging.getLogger(__name__)


@dataclass
class ScrapeMemory:
    """Last samples per pool and pod: latency means are differences between two scrapes."""

    samples: dict[str, dict[str, signals.PodSample]] = field(default_factory=dict)
    gateway_counters: dict[str, float] = field(default_factory=dict)
    """Each gateway pod's unplaced-prefills counter at the last scrape (signals.gateway_demand)."""


def _scrape_ready(api: ClusterApi, ready: list[dict], port: int) -> dict[str, tuple[str, float]]:
    """{pod name: (its metrics text, when it was read)} of the pods that answered."""
    texts = {}
    for pod in ready:
        ip = pods.pod_ip(pod)
        if not ip:
            continue
        try:
            texts[pods.pod_name(pod)] = (api.scrape(ip, port), time.monotonic())
        except Exception as e:  # noqa: BLE001 - one silent pod must not stop scaling the rest
            logger.warning("scraping %s failed: %s", pods.pod_name(pod), e)
    return texts


def gateway_demand(api: ClusterApi, owner: Owner, memory: ScrapeMemory) -> signals.GatewayDemand:
    """What the ready gateway pods report: their queued requests, summed over replicas, and the
    prompts prefilled on decode pods for want of a prefill pod since the last tick.

    The gateway does not split its queue by pool; every request needs the pool(s) on its path,
    so queued demand counts for each pool: it lifts a pool from zero, and is part of its concurrency.
    """
    ready = [p for p in api.list_pods(owner.namespace, names.gateway_selector(owner)) if pods.is_ready(p)]
    texts = {name: text for name, (text, _) in _scrape_ready(api, ready, GATEWAY_METRICS_PORT).items()}
    demand, memory.gateway_counters = signals.gateway_demand(texts, memory.gateway_counters)
    return demand


def observe_pool(api: ClusterApi, owner: Owner, role: str, selector: dict[str, str], replicas: int, signal: str,
                 demand: signals.GatewayDemand, memory: ScrapeMemory) -> PoolObservation:
    """`selector`: the pool's serving pods (engine_pool.pod_selector: a LeaderWorkerSet's leaders, so
    ready and pending count groups, as its replicas do)."""
    all_pods = api.list_pods(owner.namespace, names.selector_string(selector))
    ready = [p for p in all_pods if pods.is_ready(p)]
    starting = [p for p in all_pods if pods.is_starting(p)]
    samples = {name: signals.parse_pod_metrics(text, scraped_at=at)
               for name, (text, at) in _scrape_ready(api, ready, METRICS_PORT).items()}
    pool = signals.pool_signals(samples, memory.samples.get(role, {}), gateway_queued=demand.queued)
    memory.samples[role] = samples
    return PoolObservation(replicas=replicas, ready=len(ready), pending=len(starting), signal=pool.value(signal),
                           busy=pool.busy, gateway_queued=demand.queued,
                           prefills_unplaced=demand.unplaced_for(role))
