"""NetworkPolicies of an InferenceService: who may reach its pods.

- Engine pods: the gRPC port only from this InferenceService's gateway pods and its own engine
  pods (P/D peers: with disaggregation.kvChannel direct, prefill pods push KV to decode pods
  there); when disaggregated, the KV inbox port only from its own prefill pods (the direct
  channel's data path; of a pipeline-parallel prefill pool, its leaders); the metrics port only
  from the operator's namespace (the autoscaler scrapes it) and the namespaces in
  spec.networkPolicy.metricsNamespaces.
- Gateway pods: REST and gRPC from anywhere (the public entry point); metrics as above.
- Pipeline-parallel pools (LeaderWorkerSets): every TCP port of a pool's group pods from the pods
  of the same LeaderWorkerSet: the ranks meet at the leader's master port (and the next one), then
  gloo and NCCL connect them on ephemeral ports, which no fixed port list covers. A policy cannot
  say "the same group", so the groups of one pool admit each other; no other pod gets past the
  engine policy's ports.
- Redis, when kvStore.redis.podSelector names its pods: only this InferenceService's engine pods
  (of a pipeline-parallel pool, its leaders: workers never reach Redis) and its gateway pods when
  spec.batch.redis keeps the Batch API there, on kvStore.redis.port.

Only Ingress is restricted. Traffic from a pod's own node (kubelet probes) is always allowed.
Policies add up: two InferenceServices sharing one Redis both get in.
"""

from __future__ import annotations

from tessera_operator import batch, engine_pool, gateway, names, pod_parts
from tessera_operator.crd_engine import POOL_NAMES
from tessera_operator.names import Owner

API_VERSION = "networking.k8s.io/v1"
# The label every namespace carries (Kubernetes sets it), so a namespace is matched by its name.
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


def _tcp(port: int | str) -> dict:
    return {"protocol": "TCP", "port": port}


def _namespaces(names_: list[str]) -> list[dict]:
    return [{"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: ns}}} for ns in names_]


def metrics_namespaces(spec: dict, operator_namespace: str | None) -> list[str]:
    """Namespaces whose pods may scrape: the operator's (when known) and the configured ones."""
    found = ([operator_namespace] if operator_namespace else []) + list(spec["networkPolicy"]["metricsNamespaces"])
    return list(dict.fromkeys(found))


def _metrics_rule(spec: dict, operator_namespace: str | None, port: int) -> list[dict]:
    sources = _namespaces(metrics_namespaces(spec, operator_namespace))
    # No source at all would be "from anywhere": leave the port closed instead.
    return [{"from": sources, "ports": [_tcp(port)]}] if sources else []


def _policy(owner: Owner, name: str, labels: dict, pod_selector: dict, ingress: list[dict]) -> dict:
    return {
        "apiVersion": API_VERSION,
        "kind": "NetworkPolicy",
        "metadata": pod_parts.object_meta(owner, name, labels),
        # An empty ingress list with policyTypes Ingress admits nothing.
        "spec": {"podSelector": {"matchLabels": pod_selector}, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def _kv_inbox_rule(owner: Owner, spec: dict) -> list[dict]:
    """Prefill pods push KV blocks to decode pods' inbox port; no other pod needs it. Like the gRPC
    rule, whatever kvChannel says (pushes in flight while the gateway rolls). The policy selects
    every engine pool, but only decode pods (a group's leader) listen there; a mixed service has
    no prefill pods, so no rule (its policy stays as it was). Of a pipeline-parallel prefill pool,
    only the leaders push (the engine core sends the blocks it assembled from every stage), so
    only they are admitted, as its Service selects them."""
    if "prefill" not in names.active_pools(spec["mode"]):
        return []
    prefill = {"podSelector": {"matchLabels": engine_pool.pod_selector(owner, spec, "prefill")}}
    return [{"from": [prefill], "ports": [_tcp(engine_pool.KV_INBOX_PORT)]}]


def engine_policy(owner: Owner, spec: dict, operator_namespace: str | None) -> dict:
    # Engine pods admit each other whatever disaggregation.kvChannel says: a direct push needs it, and
    # a policy that followed the channel would refuse the pushes still in flight while the gateway rolls.
    peers = [{"podSelector": {"matchLabels": names.selector(owner, "gateway")}},
             {"podSelector": {"matchLabels": names.selector(owner, "engine")}}]
    ingress = [{"from": peers, "ports": [_tcp(engine_pool.GRPC_PORT)]}]
    ingress += _kv_inbox_rule(owner, spec)
    ingress += _metrics_rule(spec, operator_namespace, engine_pool.METRICS_PORT)
    return _policy(owner, names.engine_policy_name(owner), names.labels(owner, "engine"),
                   names.selector(owner, "engine"), ingress)


def gateway_policy(owner: Owner, spec: dict, operator_namespace: str | None) -> dict:
    # No `from`: any source, cluster or not (the Service may be a LoadBalancer).
    ingress = [{"ports": [_tcp(gateway.HTTP_PORT), _tcp(gateway.GRPC_PORT)]}]
    ingress += _metrics_rule(spec, operator_namespace, gateway.METRICS_PORT)
    return _policy(owner, names.gateway_name(owner), names.labels(owner, "gateway"),
                   names.selector(owner, "gateway"), ingress)


def _redis_engine_peers(owner: Owner, spec: dict) -> list[dict]:
    """The engine pods that talk to Redis: each pool's serving pods, as its Service selects them (of a
    pipeline-parallel pool, the leaders: the engine core holds the KV store; workers get no Redis URL).
    Every pool, active or not, as the policy did before: a pool's pods still draining after a mode
    switch keep their KV traffic."""
    return [{"podSelector": {"matchLabels": engine_pool.pod_selector(owner, spec, role)}} for role in POOL_NAMES]


def redis_policy(owner: Owner, spec: dict) -> dict | None:
    """kvStore.redis's pods: this service's engine pods that use Redis, and its gateway pods when
    spec.batch.redis keeps batches in Redis (the operator cannot tell whether that is the same Redis;
    most often it is, its default key prefix lying in the service's KV key space, and a policy that
    isolated it from the gateway would break the Batch API)."""
    redis = spec["kvStore"].get("redis") or {}
    if not redis.get("podSelector"):
        return None
    peers = _redis_engine_peers(owner, spec)
    if batch.uses_redis(spec):
        peers.append({"podSelector": {"matchLabels": names.selector(owner, "gateway")}})
    ingress = [{"from": peers, "ports": [_tcp(redis["port"])]}]
    return _policy(owner, names.redis_policy_name(owner), names.labels(owner, "redis"), dict(redis["podSelector"]),
                   ingress)


def group_policy(owner: Owner, role: str) -> dict:
    """A pipeline-parallel pool's pods (leaders and workers) admit each other on every TCP port."""
    group = {**names.selector(owner, "engine", role), engine_pool.LWS_NAME_LABEL: names.pool_name(owner, role)}
    # A port entry with a protocol and no port: every port of that protocol.
    ingress = [{"from": [{"podSelector": {"matchLabels": dict(group)}}], "ports": [{"protocol": "TCP"}]}]
    return _policy(owner, names.group_policy_name(owner, role), names.labels(owner, "engine", role), group, ingress)


def policies(owner: Owner, spec: dict, operator_namespace: str | None) -> list[dict]:
    if not spec["networkPolicy"]["enabled"]:
        return []
    out = [engine_policy(owner, spec, operator_namespace), gateway_policy(owner, spec, operator_namespace)]
    out += [group_policy(owner, role) for role in names.active_pools(spec["mode"])
            if engine_pool.is_group_pool(spec, role)]
    redis = redis_policy(owner, spec)
    return out + ([redis] if redis else [])
