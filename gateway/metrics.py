"""Prometheus metrics of the gateway, labelled by tenant and priority class."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tessera.metrics_registry import component_registry

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
# How a router's prefix query (Engine.GetLoad) ended: gateway/router.py.
PREFIX_QUERY_OUTCOMES = ("ok", "unavailable", "timeout", "error")


@dataclass(frozen=True)
class RequestMetrics:
    """The labelled children one (tenant, class) pair updates per request,
    looked up once: `labels()` costs more than the update itself."""

    ttft: object
    e2e: object
    prompt_tokens: object
    generation_tokens: object
    cached_tokens: object


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or component_registry()
        who = ["tenant", "priority_class"]
        self.requests = Counter("tessera_gateway_requests", "Requests by outcome (ok, error, cancelled, rejected)",
                                who + ["endpoint", "outcome"], registry=r)
        # By the model a request names (the base model or a LoRA adapter): only served models'
        # names become label values (gateway/catalog.py, metric_label), so the label stays bounded.
        self.model_requests = Counter("tessera_gateway_model_requests",
                                      "Requests by model (the base model or a LoRA adapter; (unknown): a name "
                                      "nothing serves) and outcome", ["model", "endpoint", "outcome"], registry=r)
        self.rejections = Counter("tessera_gateway_rejections", "Requests refused, by reason",
                                  who + ["reason"], registry=r)
        self.ttft = Histogram("tessera_gateway_time_to_first_token_seconds", "Arrival at the gateway to first token",
                              who, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tessera_gateway_e2e_request_latency_seconds", "Arrival at the gateway to the end",
                             who, buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("tessera_gateway_prompt_tokens", "Prompt tokens", who, registry=r)
        self.generation_tokens = Counter("tessera_gateway_generation_tokens", "Generated tokens", who, registry=r)
        self.cached_tokens = Counter("tessera_gateway_cached_prompt_tokens",
                                     "Prompt tokens the engine served from its prefix cache", who, registry=r)
        self.routing = Counter("tessera_gateway_routing_decisions", "Engine calls by pod and kind "
                               "(route, retry, prefill, decode)", ["pod", "role", "kind"], registry=r)
        self.prefix_hit_tokens = Counter("tessera_gateway_routed_prefix_hit_tokens",
                                         "Prompt tokens the chosen pod reported holding when routed", ["pod"],
                                         registry=r)
        self.prefix_queries = Counter("tessera_gateway_prefix_queries", "Prefix-cache queries (Engine.GetLoad) the "
                                      "router sent, by outcome (ok, unavailable, timeout, error)", ["outcome"],
                                      registry=r)
        # Looked up once (labels() costs more than the update); every outcome shows from the start, at 0.
        self.prefix_query_outcomes = {o: self.prefix_queries.labels(o) for o in PREFIX_QUERY_OUTCOMES}
        # The demand for a prefill pool at zero pods, where nothing queues: the decode pods serve
        # (tessera_operator/autoscale.py lifts the pool on its increase).
        self.prefills_unplaced = Counter(
            "tessera_gateway_prefills_unplaced",
            "Prompts that disaggregation would send to a prefill pod, prefilled by their decode pod "
            "because no prefill pod was routable", registry=r)
        self.retries = Counter("tessera_gateway_retries", "Engine calls retried on another pod before the first token",
                               registry=r)
        # What the gateway itself adds before a request's first token reaches
        # an engine: sub-millisecond buckets, the router's cost is the point.
        self.dispatch = Histogram(
            "tessera_gateway_dispatch_seconds",
            "Arrival at the gateway to its first engine call sent, less the wait in the admission queue "
            "(checks, tokenizing, routing with its prefix queries)",
            buckets=(0.0002, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.05, 0.1, 0.25, 1.0),
            registry=r)
        self.queue_length = Gauge("tessera_gateway_queue_length", "Requests waiting in the admission queue",
                                  ["priority_class"], registry=r)
        self.pushed_prefix_blocks = Gauge("tessera_gateway_pushed_prefix_blocks",
                                          "Distinct prefix-cache blocks the engine pods pushed that some pod "
                                          "holds (router.prefix_match: pushed; 0 otherwise)", registry=r)
        self.pods_routable = Gauge("tessera_gateway_pods_routable", "Engine pods taking requests", ["role"],
                                   registry=r)

        self._per_request: dict[tuple[str, str], RequestMetrics] = {}

    def for_request(self, tenant: str, priority_class: str) -> RequestMetrics:
        key = (tenant, priority_class)
        found = self._per_request.get(key)
        if found is None:
            found = self._per_request[key] = RequestMetrics(
                self.ttft.labels(*key), self.e2e.labels(*key), self.prompt_tokens.labels(*key),
                self.generation_tokens.labels(*key), self.cached_tokens.labels(*key),
            )
        return found
