"""The chart grants exactly what the operator uses: every (API group, resource, verb) in its rules
is exercised by a reconcile here, against FakeCluster recording each call as the API server's
authorizer sees it, and every call made is granted.

The scenarios are the handlers' own paths: create (with the internal Secret and a Redis policy),
status, an autoscaling pass that scales, an update to pipeline parallelism (the pool a LeaderWorkerSet),
an update that switches mode and prunes, and delete.
What kopf itself does (watching and patching InferenceServices, posting events) is listed below,
read off kopf's client code: list + watch (fetching/watching), merge-patch of the object and of
its status subresource (patching), event POST (events); no GET of single objects. Held for
escalation only: the verbs each gateway's Role grants (RBAC forbids granting what one lacks).
"""

from __future__ import annotations

import kopf
import pytest

from tessera_operator.handlers import on_change, on_delete, on_tick
from tessera_operator.reconcile import desired_objects

from .conftest import make_isvc
from .fake_cluster import FakeCluster, pod
from .test_handlers import ENGINE_METRICS, _serve, call, events, with_status  # noqa: F401 - events is a fixture
from .test_manifests import VALUES, render

KOPF_OWN = {("tessera.dev", "inferenceservices", "list"), ("tessera.dev", "inferenceservices", "watch"),
            ("tessera.dev", "inferenceservices", "patch"), ("tessera.dev", "inferenceservices/status", "patch"),
            ("", "events", "create")}


def granted(rules: list[dict]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


def escalation_only() -> set[tuple[str, str, str]]:
    gateway_role = next(o for o in desired_objects(make_isvc()) if o["kind"] == "Role")
    return granted(gateway_role["rules"])


def exercised(events) -> set[tuple[str, str, str]]:
    cluster = FakeCluster()
    memo = kopf.Memo(api=cluster, operator_namespace="tessera-system")
    redis = {"kvStore": {"redis": {"urlSecretRef": {"name": "r"}, "podSelector": {"app": "redis"}}}}
    body = make_isvc(redis)
    body = with_status(body, call(on_change, body, cluster, memo=memo))                      # create + status
    _serve(cluster, body, "mixed", [(pod("m-0", "10.0.0.1"), ENGINE_METRICS.format(waiting=40, running=8, kv=0.5))])
    body = with_status(body, call(on_tick, body, cluster, memo=memo))                        # scale up
    assert cluster.deployment("ml", "llama-engine")["spec"]["replicas"] > 1
    # Pipeline parallelism: the pool becomes a LeaderWorkerSet (created, read for status)...
    call(on_change, make_isvc({"engine": {"pipelineParallelSize": 2}}), cluster, memo=memo, reason="update")
    assert cluster.leader_worker_set("ml", "llama-engine")
    # Switch mode and drop the Redis policy: both prune.
    update = make_isvc({"mode": "disaggregated", "kvStore": {"redis": {"urlSecretRef": {"name": "r"}}}})
    call(on_change, update, cluster, memo=memo, reason="update")
    # ... and is pruned with the mode switch.
    assert {("delete", "Deployment", "llama-engine"), ("delete", "NetworkPolicy", "llama-redis"),
            ("delete", "LeaderWorkerSet", "llama-engine")} <= set(cluster.calls)
    call(on_delete, body, cluster, memo=memo, reason="delete")
    return cluster.verbs


@pytest.mark.parametrize("values", sorted(VALUES))
def test_every_granted_verb_is_used_and_every_used_verb_granted(values, events):
    used = exercised(events) | KOPF_OWN | escalation_only()
    roles = [d for d in render(VALUES[values]) if d["kind"] in ("Role", "ClusterRole")]
    assert roles
    for role in roles:
        rules = granted(role["rules"])
        assert sorted(rules - used) == [], "granted but never used"
        assert sorted(used - rules) == [], "used but not granted"


def test_secrets_are_only_read_for_existence_and_created(events):
    """The operator never lists, patches or deletes a Secret (it could otherwise read or rotate every one)."""
    assert {v for g, r, v in exercised(events) if r == "secrets"} == {"get", "create"}
