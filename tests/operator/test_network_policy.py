"""The NetworkPolicies, judged by what they let through: a small evaluator of NetworkPolicy
semantics (Ingress only) asks who may reach which pod on which port, with the pods' real labels
taken from the Deployments the operator renders."""

from __future__ import annotations

import pytest

from tessera_operator.reconcile import ObjectKey, desired_objects, stale_keys

from .conftest import make_isvc

OPERATOR_NS = "tessera-system"
ENGINE_GRPC, ENGINE_METRICS, GATEWAY_HTTP, GATEWAY_GRPC, GATEWAY_METRICS = 50061, 9090, 8000, 50051, 9090
ENGINE_HEALTH, KV_INBOX = 50062, 50063


def _matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def _peer_admits(peer: dict, source: dict, policy_ns: str) -> bool:
    pods, namespaces = peer.get("podSelector"), peer.get("namespaceSelector")
    if namespaces is None and source["namespace"] != policy_ns:
        return False  # a podSelector alone means pods of the policy's own namespace
    if namespaces is not None and not _matches(namespaces, {"kubernetes.io/metadata.name": source["namespace"]}):
        return False
    return pods is None or _matches(pods, source["labels"])


def admits(policies: list[dict], target: dict, source: dict, port: int) -> bool:
    """Whether `source` (labels, namespace) may open `port` on the pod `target` (labels, namespace)."""
    selecting = [p for p in policies if p["metadata"]["namespace"] == target["namespace"]
                 and _matches(p["spec"]["podSelector"], target["labels"])]
    if not selecting:
        return True  # not isolated
    for policy in selecting:
        for rule in policy["spec"].get("ingress", []):
            # An empty or missing list matches everything (ports and sources alike).
            # A port entry without a port: every port (of its protocol, TCP here).
            port_ok = not rule.get("ports") or any(p.get("port", port) == port for p in rule["ports"])
            from_ok = not rule.get("from") or any(_peer_admits(peer, source, target["namespace"])
                                                  for peer in rule["from"])
            if port_ok and from_ok:
                return True
    return False


def pod_of(objects: list[dict], deployment: str) -> dict:
    d = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == deployment)
    return {"labels": d["spec"]["template"]["metadata"]["labels"], "namespace": d["metadata"]["namespace"]}


def policies_of(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] == "NetworkPolicy"]


STRANGER = {"labels": {"app": "curious"}, "namespace": "ml"}
ELSEWHERE = {"labels": {}, "namespace": "other-team"}
OPERATOR = {"labels": {"app.kubernetes.io/component": "operator"}, "namespace": OPERATOR_NS}
PROMETHEUS = {"labels": {"app": "prometheus"}, "namespace": "monitoring"}
REDIS = {"labels": {"app": "redis", "role": "master"}, "namespace": "ml"}


@pytest.fixture
def pd():
    body = make_isvc({"mode": "disaggregated", "networkPolicy": {"metricsNamespaces": ["monitoring"]},
                      "kvStore": {"redis": {"urlSecretRef": {"name": "r"}, "podSelector": {"app": "redis"}}}})
    return desired_objects(body, operator_namespace=OPERATOR_NS)


def test_engine_grpc_only_from_this_gateway_and_its_own_engines(pd):
    policies = policies_of(pd)
    other = desired_objects(make_isvc(name="other"), operator_namespace=OPERATOR_NS)
    gateway, prefill, decode = (pod_of(pd, f"llama-{n}") for n in ("gateway", "prefill", "decode"))
    for engine in (prefill, decode):
        assert admits(policies, engine, gateway, ENGINE_GRPC)
        assert admits(policies, engine, prefill if engine is decode else decode, ENGINE_GRPC)  # P/D peers
        for outsider in (STRANGER, ELSEWHERE, OPERATOR, pod_of(other, "other-gateway")):
            assert not admits(policies, engine, outsider, ENGINE_GRPC)


def test_the_direct_kv_channel_lets_prefill_pods_push_to_decode_pods():
    """kvChannel direct: a prefill pod pushes KV to a decode pod's gRPC port. The engine policy
    already admits the service's own engine pods there, so both channels render the same policies;
    another InferenceService's prefill pods stay out."""
    def objects(channel: str, name: str = "llama") -> list[dict]:
        return desired_objects(make_isvc({"mode": "disaggregated", "disaggregation": {"kvChannel": channel}},
                                         name=name), operator_namespace=OPERATOR_NS)

    direct = objects("direct")
    policies = policies_of(direct)
    decode, prefill = pod_of(direct, "llama-decode"), pod_of(direct, "llama-prefill")
    assert admits(policies, decode, prefill, ENGINE_GRPC)
    assert not admits(policies, decode, prefill, ENGINE_METRICS)
    assert not admits(policies, decode, pod_of(objects("direct", "other"), "other-prefill"), ENGINE_GRPC)
    assert policies_of(objects("redis")) == policies


@pytest.mark.parametrize("channel", ["direct", "redis"])
def test_the_kv_inbox_port_only_from_this_services_prefill_pods(channel):
    """The direct channel's data path: a prefill pod opens a decode pod's inbox port; nobody else
    does (the gateway and decode pods included). Whatever the channel, like the gRPC rule: a policy
    that followed it would refuse the pushes in flight while the gateway rolls."""
    def objects(name: str = "llama") -> list[dict]:
        return desired_objects(make_isvc({"mode": "disaggregated", "disaggregation": {"kvChannel": channel},
                                          "networkPolicy": {"metricsNamespaces": ["monitoring"]}}, name=name),
                               operator_namespace=OPERATOR_NS)

    pd = objects()
    policies = policies_of(pd)
    gateway, prefill, decode = (pod_of(pd, f"llama-{n}") for n in ("gateway", "prefill", "decode"))
    assert admits(policies, decode, prefill, KV_INBOX)
    other = objects("other")
    for outsider in (gateway, decode, STRANGER, ELSEWHERE, OPERATOR, PROMETHEUS,
                     pod_of(other, "other-prefill"), pod_of(other, "other-gateway")):
        assert not admits(policies, decode, outsider, KV_INBOX), outsider
    # The rule opens that port alone: prefill pods reach nothing else of a decode pod beyond gRPC.
    for port in (ENGINE_METRICS, ENGINE_HEALTH, KV_INBOX + 1, 22):
        assert not admits(policies, decode, prefill, port), port


def test_mixed_engines_keep_the_kv_inbox_port_closed():
    """No prefill pool, no pushes: a mixed service's engine policy has no rule for the port at all
    (so its policy is as it was), and nobody, its own pods included, opens it."""
    objects = desired_objects(make_isvc({"disaggregation": {"kvChannel": "direct"}}), operator_namespace=OPERATOR_NS)
    engine = pod_of(objects, "llama-engine")
    for source in (engine, pod_of(objects, "llama-gateway"), STRANGER, OPERATOR):
        assert not admits(policies_of(objects), engine, source, KV_INBOX)
    rules = next(p for p in policies_of(objects) if p["metadata"]["name"] == "llama-engine")["spec"]["ingress"]
    assert KV_INBOX not in {port["port"] for rule in rules for port in rule["ports"]}


def test_metrics_ports_only_from_the_operator_and_monitoring_namespaces(pd):
    policies = policies_of(pd)
    for target, port in ((pod_of(pd, "llama-decode"), ENGINE_METRICS), (pod_of(pd, "llama-gateway"), GATEWAY_METRICS)):
        assert admits(policies, target, OPERATOR, port) and admits(policies, target, PROMETHEUS, port)
        for outsider in (STRANGER, ELSEWHERE, pod_of(pd, "llama-gateway")):
            assert not admits(policies, target, outsider, port)


def test_gateway_public_ports_stay_open(pd):
    gateway = pod_of(pd, "llama-gateway")
    for source in (STRANGER, ELSEWHERE):
        assert admits(policies_of(pd), gateway, source, GATEWAY_HTTP)
        assert admits(policies_of(pd), gateway, source, GATEWAY_GRPC)
    # Nothing else on the gateway (the policy has no rule without ports).
    assert not admits(policies_of(pd), gateway, STRANGER, 22)


def test_redis_only_from_this_services_engines(pd):
    policies = policies_of(pd)
    assert admits(policies, REDIS, pod_of(pd, "llama-prefill"), 6379)
    assert admits(policies, REDIS, pod_of(pd, "llama-decode"), 6379)
    assert not admits(policies, REDIS, pod_of(pd, "llama-gateway"), 6379)
    assert not admits(policies, REDIS, STRANGER, 6379)
    # Without kvStore.redis.podSelector the operator leaves Redis alone.
    plain = desired_objects(make_isvc({"kvStore": {"redis": {"urlSecretRef": {"name": "r"}}}}))
    assert admits(policies_of(plain), REDIS, STRANGER, 6379)
    assert {o["metadata"]["name"] for o in policies_of(plain)} == {"llama-engine", "llama-gateway"}


def test_without_a_known_metrics_namespace_the_metrics_ports_are_closed():
    """No source at all must not turn into "from anywhere"."""
    objects = desired_objects(make_isvc())  # no operator namespace, no metricsNamespaces
    assert not admits(policies_of(objects), pod_of(objects, "llama-engine"), OPERATOR, ENGINE_METRICS)
    assert not admits(policies_of(objects), pod_of(objects, "llama-engine"), STRANGER, ENGINE_METRICS)
    assert admits(policies_of(objects), pod_of(objects, "llama-engine"), pod_of(objects, "llama-gateway"), ENGINE_GRPC)


def test_switched_off_they_are_pruned():
    on = desired_objects(make_isvc())
    off = desired_objects(make_isvc({"networkPolicy": {"enabled": False}}))
    assert policies_of(off) == []
    assert set(stale_keys([ObjectKey.of(o) for o in on], off)) == {
        ObjectKey("networking.k8s.io/v1", "NetworkPolicy", "llama-engine"),
        ObjectKey("networking.k8s.io/v1", "NetworkPolicy", "llama-gateway")}
