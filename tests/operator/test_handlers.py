"""The kopf handlers with real kopf objects (registry, Body, Patch, Memo, settings, event queue)
against FakeCluster. What this leaves unverified without an API server: kopf's own watch/patch
traffic, server-side apply's field ownership on a real server, garbage collection through owner
references, and RBAC enforcement (the chart's rules are checked against the calls in test_manifests).
kopf's own traffic is exercised by tests/operator/emulated/ (the `tessera operator` process against
an API emulator), which also took over the tests that only repeated what it checks end to end
(readiness of every component, pruning on a mode switch, an invalid spec, a failed apply retried)."""

from __future__ import annotations

import asyncio
import base64
import logging

import kopf
import pytest
from kopf._core.engines import posting  # the queue kopf.info/kopf.warn post to

from tessera.internal_secret import MIN_SECRET_CHARS
from tessera_operator import handlers
from tessera_operator.handlers import on_change, on_delete, on_tick
from tessera_operator.names import Owner, gateway_selector, pool_selector
from tessera_operator.reconcile import ObjectKey

from .conftest import make_isvc
from .fake_cluster import FakeCluster, pod

LOG = logging.getLogger("test")


@pytest.fixture
def events():
    """Install kopf's posting context; yield a function returning the (type, reason, message) posted so far."""
    loop = asyncio.new_event_loop()
    queue: asyncio.Queue = asyncio.Queue()
    tokens = [posting.settings_var.set(kopf.OperatorSettings()), posting.event_queue_var.set(queue),
              posting.event_queue_loop_var.set(loop)]
    seen = []

    def drain():
        loop.run_until_complete(asyncio.sleep(0))
        while not queue.empty():
            e = queue.get_nowait()
            seen.append((e.type, e.reason, e.message))
        return seen

    yield drain
    for var, token in zip((posting.settings_var, posting.event_queue_var, posting.event_queue_loop_var), tokens):
        var.reset(token)
    loop.close()


@pytest.fixture
def cluster():
    return FakeCluster()


def call(handler, body: dict, cluster: FakeCluster, memo: kopf.Memo | None = None, reason="create"):
    """Call a handler with the kwargs kopf passes; return the patch it produced."""
    patch = kopf.Patch()
    kbody = kopf.Body(body)
    handler(body=kbody, spec=kbody.spec, meta=kbody.meta, status=kbody.status, patch=patch,
            memo=memo if memo is not None else kopf.Memo(api=cluster), reason=reason, logger=LOG,
            name=kbody.meta.name, namespace=kbody.meta.namespace)
    return patch


def with_status(body: dict, patch: kopf.Patch) -> dict:
    """The resource as kopf would see it after its status patch (merge patch; None deletes)."""
    status = dict(body.get("status") or {})
    for key, value in patch.get("status", {}).items():
        if isinstance(value, dict) and isinstance(status.get(key), dict):
            merged = {**status[key], **value}
            status[key] = {k: v for k, v in merged.items() if v is not None}
        else:
            status[key] = value
    return {**body, "status": status}


def test_registration_covers_every_event():
    registry = kopf.OperatorRegistry()
    handlers.register(registry, interval=7)
    changing = {(h.reason, h.fn) for h in registry._changing.get_all_handlers()}
    assert {("create", on_change), ("update", on_change), ("delete", on_delete)} <= changing
    assert any(h.fn is on_change and h.initial for h in registry._changing.get_all_handlers())  # resume
    delete = next(h for h in registry._changing.get_all_handlers() if h.fn is on_delete)
    assert not delete.requires_finalizer
    (timer,) = registry._spawning.get_all_handlers()
    assert timer.fn is on_tick and timer.interval == 7
    assert all(h.selector.group == "tessera.dev" and h.selector.any_name == "inferenceservices"
               for h in registry._changing.get_all_handlers())


def test_startup_settings_keep_bookkeeping_out_of_status():
    settings = kopf.OperatorSettings()
    handlers.configure(settings)
    assert isinstance(settings.persistence.progress_storage, kopf.AnnotationsProgressStorage)
    assert isinstance(settings.persistence.diffbase_storage, kopf.AnnotationsDiffBaseStorage)
    assert settings.scanning.disabled


def test_create_applies_everything_and_reports_status(cluster, events):
    body = make_isvc()
    patch = call(on_change, body, cluster)
    applied = [c[1:] for c in cluster.calls if c[0] == "apply"]
    assert applied[:4] == [("ServiceAccount", "llama-gateway"), ("Role", "llama-gateway"),
                           ("RoleBinding", "llama-gateway"), ("ConfigMap", "llama-gateway")]
    # 10 applied (8 objects and 2 NetworkPolicies) and the internal Secret, created.
    assert len(cluster.objects) == 11
    status = patch["status"]
    assert status["observedGeneration"] == 1 and status["url"] == "http://llama-gateway.ml.svc:8000"
    assert status["pools"]["mixed"] == {"desiredReplicas": 1, "readyReplicas": 0}
    conditions = {c["type"]: c for c in status["conditions"]}
    assert set(conditions) == {"GatewayReady", "EngineReady", "Ready"}
    assert conditions["Ready"]["status"] == "False" and conditions["EngineReady"]["reason"] == "NoReadyPods"
    assert ("Normal", "Applied", "10 objects applied (create)") in events()
    assert ("Normal", "Created", "Secret llama-internal with a new internal secret") in events()


def test_applying_twice_changes_nothing(cluster, events):
    body = make_isvc()
    call(on_change, body, cluster)
    first = {k: dict(v) for k, v in cluster.objects.items()}
    call(on_change, body, cluster, reason="resume")
    assert cluster.objects == first
    assert not [c for c in cluster.calls if c[0] == "delete"]


def test_delete_forgets_memory_and_leaves_children_to_the_garbage_collector(cluster, events):
    memo = kopf.Memo(api=cluster, scalers={"mixed": object()}, scrapes=object())
    call(on_delete, make_isvc(), cluster, memo=memo, reason="delete")
    assert "scalers" not in memo and "scrapes" not in memo
    assert cluster.calls == []


def test_timer_puts_back_a_hand_edited_replica_count(cluster, events):
    body = make_isvc({"autoscaling": {"enabled": False}, "pools": {"mixed": {"replicas": 2}}})
    call(on_change, body, cluster)
    cluster.deployment("ml", "llama-engine")["spec"]["replicas"] = 7  # kubectl scale by hand
    call(on_tick, body, cluster)
    assert cluster.deployment("ml", "llama-engine")["spec"]["replicas"] == 2


ENGINE_METRICS = """# TYPE tessera_num_requests_waiting gauge
tessera_num_requests_waiting{{model_name="m"}} {waiting}
# TYPE tessera_num_requests_running gauge
tessera_num_requests_running{{model_name="m"}} {running}
# TYPE tessera_kv_cache_usage_perc gauge
tessera_kv_cache_usage_perc{{model_name="m"}} {kv}
"""
GATEWAY_METRICS = """# TYPE tessera_gateway_queue_length gauge
tessera_gateway_queue_length{{priority_class="standard"}} {queued}
"""


def _serve(cluster, body, role, pods_and_metrics, queued=0):
    owner = Owner.of(body)
    cluster.pods[pool_selector(owner, role)] = [p for p, _ in pods_and_metrics]
    for p, text in pods_and_metrics:
        if text is not None:
            cluster.metrics[f"{p['status']['podIP']}:9090"] = text
    cluster.pods[gateway_selector(owner)] = [pod("gw-0", "10.0.9.1")]
    cluster.metrics["10.0.9.1:9090"] = GATEWAY_METRICS.format(queued=queued)  # its metrics port, not the public one


def test_timer_scales_decode_on_kv_usage_and_leaves_prefill(cluster, events):
    body = make_isvc({"mode": "disaggregated"})
    patch = call(on_change, body, cluster)
    body = with_status(body, patch)
    memo = kopf.Memo(api=cluster)
    _serve(cluster, body, "prefill", [(pod("p-0", "10.0.0.1"), ENGINE_METRICS.format(waiting=4, running=2, kv=0.1))])
    _serve(cluster, body, "decode", [(pod("d-0", "10.0.1.1"), ENGINE_METRICS.format(waiting=0, running=30, kv=1.0))])
    patch = call(on_tick, body, cluster, memo=memo)
    assert cluster.deployment("ml", "llama-decode")["spec"]["replicas"] == 2  # ceil(1 * 1.0 / 0.8)
    assert cluster.deployment("ml", "llama-prefill")["spec"]["replicas"] == 1  # queue 4 == target
    assert patch["status"]["pools"]["decode"]["desiredReplicas"] == 2
    assert patch["status"]["pools"]["decode"]["lastScaleTime"]
    (event,) = [e for e in events() if e[1] == "ScaleUp"]
    assert event[2].startswith("decode pool 1 -> 2: kvUsage 1 vs target 0.8")
    # The next tick reads the decision back from status: no second jump while the pod is pending.
    body = with_status(body, patch)
    _serve(cluster, body, "decode", [(pod("d-0", "10.0.1.1"), ENGINE_METRICS.format(waiting=0, running=30, kv=0.7)),
                                     (pod("d-1", "10.0.1.2", ready=False, phase="Pending"), None)])
    patch = call(on_tick, body, cluster, memo=memo)
    assert cluster.deployment("ml", "llama-decode")["spec"]["replicas"] == 2
    decode = patch["status"]["pools"]["decode"]
    assert decode["desiredReplicas"] == 2
    assert decode["lastScaleTime"] == body["status"]["pools"]["decode"]["lastScaleTime"]
    assert len([e for e in events() if e[1] == "ScaleUp"]) == 1


def test_timer_scales_on_concurrency_with_the_gateways_queue(cluster, events):
    body = make_isvc({"pools": {"mixed": {"replicas": 2, "maxReplicas": 8}},
                      "autoscaling": {"mixed": {"signal": "concurrency"}}})
    body = with_status(body, call(on_change, body, cluster))
    engine = ENGINE_METRICS.format(waiting=1, running=6, kv=0.3)  # nothing much waits on the pods
    _serve(cluster, body, "mixed", [(pod("m-0", "10.0.0.1"), engine), (pod("m-1", "10.0.0.2"), engine)], queued=18)
    call(on_tick, body, cluster, memo=kopf.Memo(api=cluster))
    assert cluster.deployment("ml", "llama-engine")["spec"]["replicas"] == 4  # ceil(2 x ((7 + 7 + 18) / 2) / 8)
    (event,) = [e for e in events() if e[1] == "ScaleUp"]
    assert event[2].startswith("mixed pool 2 -> 4: concurrency 16 vs target 8")


def test_timer_lifts_a_pool_from_zero_on_gateway_demand(cluster, events):
    body = make_isvc({"pools": {"mixed": {"replicas": 0, "minReplicas": 0}}})
    patch = call(on_change, body, cluster)
    body = with_status(body, patch)
    assert cluster.deployment("ml", "llama-engine")["spec"]["replicas"] == 0
    assert {c["type"]: c["reason"] for c in patch["status"]["conditions"]}["EngineReady"] == "ScaledToZero"
    _serve(cluster, body, "mixed", [], queued=3)
    call(on_tick, body, cluster)
    assert cluster.deployment("ml", "llama-engine")["spec"]["replicas"] == 1
    assert any(e[1] == "ScaleFromZero" for e in events())


def test_timer_survives_a_pod_that_does_not_answer(cluster, events):
    body = make_isvc()
    body = with_status(body, call(on_change, body, cluster))
    _serve(cluster, body, "mixed", [(pod("m-0", "10.0.0.1"), None)])  # no /metrics
    call(on_tick, body, cluster)
    assert cluster.deployment("ml", "llama-engine")["spec"]["replicas"] == 1


def test_timer_skips_an_invalid_resource(cluster, events):
    body = make_isvc({"mode": "hybrid"})
    call(on_tick, body, cluster)
    assert cluster.calls == []


def test_internal_secret_is_created_once_and_never_rewritten(cluster, events):
    body = make_isvc()
    call(on_change, body, cluster)
    secret = cluster.secret("ml", "llama-internal")
    value = base64.b64decode(secret["data"]["internal-secret"])
    assert len(value) >= MIN_SECRET_CHARS and secret["immutable"] is True
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-1234"  # goes with the InferenceService
    call(on_change, body, cluster, reason="update")
    call(on_tick, body, cluster)
    assert cluster.secret("ml", "llama-internal") == secret
    assert [c for c in cluster.calls if c[0] == "create"] == [("create", "Secret", "llama-internal")]
    assert not [c for c in cluster.calls if c[0] == "apply" and c[1] == "Secret"]  # never server-side applied
    # Deleted by hand: the next pass makes a new one, with a new value.
    del cluster.objects[("ml", ObjectKey("v1", "Secret", "llama-internal"))]
    call(on_tick, body, cluster)
    assert base64.b64decode(cluster.secret("ml", "llama-internal")["data"]["internal-secret"]) != value


def test_a_secret_made_meanwhile_is_no_error(cluster, events):
    """Exists check says no, create gets 409 (another pass or a user was faster): fine, nothing reported."""
    cluster.secret_exists = lambda namespace, name: False
    call(on_change, make_isvc(), cluster)
    call(on_change, make_isvc(), cluster, reason="resume")
    assert len([c for c in cluster.calls if c[0] == "create"]) == 2
    assert len([e for e in events() if e[1] == "Created"]) == 1


def test_the_users_own_internal_secret_is_used_and_none_created(cluster, events):
    call(on_change, make_isvc({"internalSecretRef": {"name": "mine"}}), cluster)
    assert cluster.secret("ml", "llama-internal") is None
    assert not [c for c in cluster.calls if c[0] in ("create", "secret_exists")]
    volumes = cluster.deployment("ml", "llama-engine")["spec"]["template"]["spec"]["volumes"]
    assert {"key": "internal-secret", "path": "internal-secret"} in next(
        v for v in volumes if v["name"] == "internal-secret")["secret"]["items"]


def test_policies_admit_the_operators_own_namespace_to_the_metrics_ports(cluster, events):
    call(on_change, make_isvc(), cluster, memo=kopf.Memo(api=cluster, operator_namespace="tessera-system"))
    for name in ("llama-engine", "llama-gateway"):
        policy = cluster.objects[("ml", ObjectKey("networking.k8s.io/v1", "NetworkPolicy", name))]
        metrics = [rule for rule in policy["spec"]["ingress"] if rule["ports"] == [{"protocol": "TCP", "port": 9090}]]
        assert metrics == [{"from": [{"namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": "tessera-system"}}}], "ports": [{"protocol": "TCP", "port": 9090}]}]
