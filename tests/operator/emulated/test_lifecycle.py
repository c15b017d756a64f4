"""The real `tessera operator` process against the API emulator: what a user sees when they apply
an example, their Deployments become available, they edit the spec, and they delete it."""

from __future__ import annotations

import functools
import time

import pytest

from tessera_operator import crd

from ..test_manifests import render
from ..test_monitoring_chart import _matches
from .conftest import NAMESPACE, TICK_S, collection, example, wait_for

FINALIZER = f"{crd.GROUP}/finalizer"
MANAGED_BY = {"app.kubernetes.io/managed-by": "tessera-operator"}


def expected_objects(body: dict, mode: str | None = None) -> set[tuple[str, str]]:
    """What an InferenceService owns, spelled out (not computed by the operator's own code)."""
    name, spec = body["metadata"]["name"], body["spec"]
    mode = mode or spec.get("mode", "mixed")
    pools = [f"{name}-engine"] if mode == "mixed" else [f"{name}-prefill", f"{name}-decode"]
    gateway = f"{name}-gateway"
    redis = [("NetworkPolicy", f"{name}-redis")] if spec.get("kvStore", {}).get("redis", {}).get("podSelector") else []
    return ({("Deployment", p) for p in pools} | {("Service", p) for p in pools} | set(redis)
            | {("Deployment", gateway), ("Service", gateway), ("ConfigMap", gateway), ("ServiceAccount", gateway),
               ("Role", gateway), ("RoleBinding", gateway), ("Secret", f"{name}-internal"),
               ("NetworkPolicy", f"{name}-engine"), ("NetworkPolicy", gateway)})


@functools.cache
def chart_monitors() -> dict[str, dict]:
    """The chart's monitors as a user turns them on: a PodMonitor for the gateway's pods and a
    ServiceMonitor for the engine pools' Services; and the default PodMonitor (both components)."""
    split = render({"monitoring": {"podMonitor": {"enabled": True, "components": ["gateway"]},
                                   "serviceMonitor": {"enabled": True}}})
    both = render({"monitoring": {"podMonitor": {"enabled": True}}})
    return {"gateway pods": next(d for d in split if d["kind"] == "PodMonitor")["spec"],
            "engine services": next(d for d in split if d["kind"] == "ServiceMonitor")["spec"],
            "all pods": next(d for d in both if d["kind"] == "PodMonitor")["spec"]}


def applied(cluster, name: str) -> dict:
    """The InferenceService once the operator has reconciled it (status written, Applied posted)."""
    wait_for(lambda: "Applied" in cluster.reasons(name) and cluster.condition(name), f"{name} to be reconciled")
    return cluster.isvc(name)


@pytest.mark.parametrize("which", ["mixed", "disaggregated", "lora"])
def test_each_example_gets_its_workloads_status_and_events(cluster, operator, which):
    body = example(which)
    name, mode = body["metadata"]["name"], body["spec"].get("mode", "mixed")
    cluster.apply_isvc(body)
    isvc = applied(cluster, name)
    uid = isvc["metadata"]["uid"]

    owned = wait_for(lambda: (o := cluster.owned(name)) and set(o) == expected_objects(body) and o,
                     f"{name}'s objects", logs=operator.log)
    for (kind, obj_name), obj in owned.items():
        meta = obj["metadata"]
        assert meta["ownerReferences"] == [{"apiVersion": crd.API_VERSION, "kind": crd.KIND, "name": name,
                                            "uid": uid, "controller": True}], (kind, obj_name)
        assert MANAGED_BY.items() <= meta["labels"].items(), (kind, obj_name)
    assert isvc["metadata"]["finalizers"] == [FINALIZER]  # kopf's, for the timer: one, not doubled

    # Replicas as the spec asks (the autoscaler holds: no pod is ready to measure).
    deployments = {n: o for (k, n), o in owned.items() if k == "Deployment"}
    pools = ["mixed"] if mode == "mixed" else ["prefill", "decode"]
    for pool in pools:
        deployment = deployments[f"{name}-engine" if pool == "mixed" else f"{name}-{pool}"]
        assert deployment["spec"]["replicas"] == body["spec"]["pools"][pool]["replicas"]
        args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--served-model-name") + 1] == body["spec"]["model"]["name"]
        assert args[args.index("--role") + 1] == pool
    assert deployments[f"{name}-gateway"]["spec"]["replicas"] == body["spec"]["gateway"].get("replicas", 1)

    # The chart's monitors select these pods and Services on their metrics port.
    templates = {n: d["spec"]["template"] for n, d in deployments.items()}
    monitors = chart_monitors()
    for deployment_name, template in templates.items():
        ports = [p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])]
        assert "metrics" in ports, deployment_name
        assert _matches(monitors["all pods"]["selector"], template["metadata"]["labels"]), deployment_name
        assert _matches(monitors["gateway pods"]["selector"], template["metadata"]["labels"]) \
            == deployment_name.endswith("-gateway")
    engine_services = sorted(n for (k, n), s in owned.items()
                             if k == "Service" and _matches(monitors["engine services"]["selector"],
                                                            s["metadata"]["labels"]))
    assert engine_services == sorted(n for n in deployments if not n.endswith("-gateway"))
    for service in engine_services:
        assert "metrics" in [p["name"] for p in owned[("Service", service)]["spec"]["ports"]]
    # Each NetworkPolicy isolates exactly the pods it is named for; every pod is isolated.
    policies = {n: o["spec"] for (k, n), o in owned.items() if k == "NetworkPolicy"}
    for policy_name, policy in policies.items():
        wanted_labels = policy["podSelector"]["matchLabels"].items()
        selected = {n for n, t in templates.items() if wanted_labels <= t["metadata"]["labels"].items()}
        if policy_name.endswith("-redis"):  # the Redis pods', which admit this service's engine pods
            assert policy["podSelector"]["matchLabels"] == body["spec"]["kvStore"]["redis"]["podSelector"]
            assert selected == set()
            continue
        want = {f"{name}-gateway"} if policy_name.endswith("-gateway") else set(deployments) - {f"{name}-gateway"}
        assert selected == want, policy_name
    # The engine pods' Service selects them (the gateway finds its engines through it).
    for service in engine_services:
        selector = owned[("Service", service)]["spec"]["selector"]
        assert [n for n, t in templates.items() if selector.items() <= t["metadata"]["labels"].items()] == [service]

    # Status, through the status subresource, for this generation.
    status = isvc["status"]
    assert status["observedGeneration"] == isvc["metadata"]["generation"] == 1
    assert status["mode"] == mode and status["url"] == f"http://{name}-gateway.{NAMESPACE}.svc:8000"
    assert {p: s["desiredReplicas"] for p, s in status["pools"].items() if s} \
        == {p: body["spec"]["pools"][p]["replicas"] for p in pools}
    types = [c["type"] for c in status["conditions"]]
    assert types == ["GatewayReady"] + [{"mixed": "EngineReady", "prefill": "PrefillReady",
                                         "decode": "DecodeReady"}[p] for p in pools] + ["Ready"]
    ready = cluster.condition(name)
    assert (ready["status"], ready["reason"]) == ("False", "ComponentsNotReady")
    if which == "lora":
        assert status["loras"] == [lora["name"] for lora in body["spec"]["loras"]]

    # Events on the resource: the internal Secret made, the objects applied.
    events = {e["reason"]: e for e in cluster.events(name)}
    assert events["Created"]["message"] == f"Secret {name}-internal with a new internal secret"
    assert events["Applied"]["message"] == f"{len(expected_objects(body)) - 1} objects applied (create)"
    assert all(e["involvedObject"]["uid"] == uid and e["type"] == "Normal" for e in events.values())
    assert operator.alive


def test_ready_follows_the_deployments_availability(cluster, operator):
    body = example("disaggregated")
    name = body["metadata"]["name"]
    cluster.apply_isvc(body)
    applied(cluster, name)
    deployments = [f"{name}-gateway", f"{name}-prefill", f"{name}-decode"]
    wait_for(lambda: all(cluster.deployment(d) for d in deployments), "the Deployments")

    for deployment in deployments[:2]:
        cluster.set_ready(deployment, 1)
    # Two of three available: not Ready, and the condition says which one waits.
    wait_for(lambda: (cluster.condition(name, "PrefillReady") or {}).get("status") == "True", "PrefillReady")
    ready = cluster.condition(name)
    assert (ready["status"], ready["message"]) == ("False", "not ready: DecodeReady")

    cluster.set_ready(f"{name}-decode", 2)
    up = wait_for(lambda: (c := cluster.condition(name)) and c["status"] == "True" and c, "Ready True",
                  logs=operator.log)
    assert up["reason"] == "AllComponentsReady"
    status = cluster.isvc(name)["status"]
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "GatewayReady": "True", "PrefillReady": "True", "DecodeReady": "True", "Ready": "True"}
    assert set(status["pools"]) == {"prefill", "decode"}  # no pool of the other mode
    assert status["pools"]["decode"]["readyReplicas"] == 2 and status["pools"]["prefill"]["readyReplicas"] == 1

    # The decode pool loses its pods: Ready goes down with it, and says why.
    cluster.set_ready(f"{name}-decode", 0)
    down = wait_for(lambda: (c := cluster.condition(name)) and c["status"] == "False" and c, "Ready False")
    assert down["message"] == "not ready: DecodeReady"
    assert down["lastTransitionTime"] >= up["lastTransitionTime"]
    decode = cluster.condition(name, "DecodeReady")
    assert (decode["reason"], decode["message"]) == ("NoReadyPods", "0/2 pods ready")
    assert cluster.condition(name, "GatewayReady")["status"] == "True"


def test_spec_edits_patch_the_workloads_in_place(cluster, start_operator):
    """Engine flags, the model and the replica bounds change: the same objects (same uid) take the
    new spec, nothing is recreated; the operator writes status and never the spec. The timer is
    a minute away: the change handler alone applies the edit and reports it."""
    operator = start_operator(interval=60)
    body = example("mixed")
    name = body["metadata"]["name"]
    cluster.apply_isvc(body)
    applied(cluster, name)
    before = wait_for(lambda: (o := cluster.owned(name)) and len(o) == len(expected_objects(body)) and o,
                      "the objects")
    engine = before[("Deployment", f"{name}-engine")]
    gateway_hash = before[("Deployment", f"{name}-gateway")]["spec"]["template"]["metadata"]["annotations"]

    edit = {"spec": {"engine": {"maxNumBatchedTokens": 8192},
                     "model": {"name": "llama-3.1-8b-instruct-v2", "pvc": {"path": "llama-3.1-8b-instruct-v2"}},
                     "pools": {"mixed": {"minReplicas": 2, "maxReplicas": 3}}}}
    cluster.edit_isvc(name, edit)

    def engine_args():
        return cluster.deployment(f"{name}-engine")["spec"]["template"]["spec"]["containers"][0]["args"]

    args = wait_for(lambda: "8192" in (a := engine_args()) and "llama-3.1-8b-instruct-v2" in a and a,
                    "the edit on the engine Deployment", logs=operator.log)
    assert args[args.index("--max-num-batched-tokens") + 1] == "8192"
    assert args[args.index("--served-model-name") + 1] == "llama-3.1-8b-instruct-v2"
    after = cluster.owned(name)
    assert set(after) == set(before)
    assert {k: o["metadata"]["uid"] for k, o in after.items()} == {k: o["metadata"]["uid"] for k, o in before.items()}
    updated = after[("Deployment", f"{name}-engine")]
    assert updated["metadata"]["generation"] == engine["metadata"]["generation"] + 1
    assert updated["metadata"]["creationTimestamp"] == engine["metadata"]["creationTimestamp"]
    # The gateway's config names the model: its pods roll (a new hash), the Deployment stays.
    gateway = after[("Deployment", f"{name}-gateway")]
    assert gateway["spec"]["template"]["metadata"]["annotations"] != gateway_hash
    # 2 replicas sit within the new bounds [2, 3]: kept.
    assert updated["spec"]["replicas"] == 2

    wait_for(lambda: (cluster.isvc(name).get("status") or {}).get("observedGeneration") == 2, "status of generation 2")
    isvc = cluster.isvc(name)
    assert isvc["metadata"]["generation"] == 2  # one user edit; the operator's writes are status and metadata
    assert isvc["spec"]["pools"]["mixed"] == {**body["spec"]["pools"]["mixed"], "minReplicas": 2, "maxReplicas": 3}
    wait_for(lambda: any(e["reason"] == "Applied" and e["message"].endswith("(update)")
                         for e in cluster.events(name)), "the update's Applied event")

    # The replica bounds move under the running pool: the Deployment follows them.
    cluster.edit_isvc(name, {"spec": {"pools": {"mixed": {"minReplicas": 4, "maxReplicas": 5}}}})
    wait_for(lambda: cluster.deployment(f"{name}-engine")["spec"]["replicas"] == 4,
             "replicas raised to the new minimum", logs=operator.log)
    assert cluster.deployment(f"{name}-engine")["metadata"]["uid"] == engine["metadata"]["uid"]
    wait_for(lambda: cluster.isvc(name)["status"]["pools"]["mixed"]["desiredReplicas"] == 4, "status of 4 replicas")
    assert operator.alive


def test_a_mode_switch_prunes_the_old_pool(cluster, operator):
    body = example("mixed")
    name = body["metadata"]["name"]
    cluster.apply_isvc(body)
    applied(cluster, name)
    before = wait_for(lambda: (o := cluster.owned(name)) and set(o) == expected_objects(body) and o,
                      "the mixed pool")
    cluster.edit_isvc(name, {"spec": {"mode": "disaggregated"}})
    after = wait_for(lambda: (o := cluster.owned(name)) and set(o) == expected_objects(body, "disaggregated") and o,
                     "the prefill and decode pools, and no mixed pool", logs=operator.log)
    kept = set(before) & set(after)
    assert {k: after[k]["metadata"]["uid"] for k in kept} == {k: before[k]["metadata"]["uid"] for k in kept}
    assert cluster.deployment(f"{name}-engine") is None
    wait_for(lambda: sorted(e["message"] for e in cluster.events(name) if e["reason"] == "Deleted")
             == [f"Deployment {name}-engine is no longer part of the spec",
                 f"Service {name}-engine is no longer part of the spec"], "the Deleted events")
    wait_for(lambda: cluster.isvc(name)["status"]["mode"] == "disaggregated", "status in the new mode")
    status = cluster.isvc(name)["status"]
    assert "mixed" not in status["pools"] and set(status["pools"]) == {"prefill", "decode"}


def test_a_hand_edit_of_a_managed_deployment_is_taken_back(cluster, operator):
    body = example("mixed")
    name = body["metadata"]["name"]
    cluster.apply_isvc(body)
    applied(cluster, name)
    path = collection("Deployment") + f"/{name}-engine"
    wait_for(lambda: cluster.deployment(f"{name}-engine"), "the engine Deployment")
    cluster.patch(path, {"spec": {"replicas": 5}})  # kubectl scale --replicas 5
    assert cluster.deployment(f"{name}-engine")["spec"]["replicas"] == 5
    wait_for(lambda: cluster.deployment(f"{name}-engine")["spec"]["replicas"] == 2, "the next tick to take it back",
             timeout=5 * TICK_S + 5, logs=operator.log)


def test_delete_runs_the_finalizer_and_leaves_the_children_to_garbage_collection(cluster, operator):
    """The operator removes nothing itself on delete: its objects carry controller owner references and
    the API server's garbage collector removes them. The emulator has no garbage collector, so this
    checks the finalizer ran and the resource went, and that every child would be collected (it names
    the deleted resource's uid as its controller)."""
    body = example("mixed")
    name = body["metadata"]["name"]
    cluster.apply_isvc(body)
    uid = applied(cluster, name)["metadata"]["uid"]
    owned = wait_for(lambda: (o := cluster.owned(name)) and len(o) == len(expected_objects(body)) and o,
                     "the objects")

    cluster.delete(cluster.isvc_path(name))
    wait_for(lambda: cluster.isvc(name) is None, "the resource to go (its finalizer released)", logs=operator.log)
    assert f"{name} deleted; its objects go with it (owner references)" in operator.log()
    wait_for(lambda: "Handler 'on_delete' succeeded." in operator.log(), "kopf's record of the delete handler")
    # No garbage collector here: the children remain, each owned by the resource that is gone.
    left = cluster.owned(name)
    assert set(left) == set(owned)
    for key, obj in left.items():
        (ref,) = obj["metadata"]["ownerReferences"]
        assert (ref["uid"], ref["controller"], ref["kind"]) == (uid, True, crd.KIND), key
    # The operator stopped its timer: no write to the children after the delete.
    versions = {k: o["metadata"]["resourceVersion"] for k, o in left.items()}
    time.sleep(3 * TICK_S)
    assert {k: o["metadata"]["resourceVersion"] for k, o in cluster.owned(name).items()} == versions
    assert operator.alive


def test_disaggregated_pools_under_pipeline_parallelism_are_a_leader_worker_set_each(cluster, operator):
    """The disaggregated example (Redis, host memory, the direct channel) with prefill P=2 x TP=2 and
    decode P=2: two owned LeaderWorkerSets of their own layout, no pool Deployment, each Service on
    leaders, a group policy each; the Redis URL and the inbox on leaders only; Ready once both pools'
    groups are."""
    body = example("disaggregated")
    body["spec"]["pools"]["prefill"].update(pipelineParallelSize=2, tensorParallelSize=2)
    body["spec"]["pools"]["decode"]["pipelineParallelSize"] = 2
    name = body["metadata"]["name"]
    cluster.apply_isvc(body)
    isvc = applied(cluster, name)
    paths = {pool: f"{collection('LeaderWorkerSet')}/{name}-{pool}" for pool in ("prefill", "decode")}
    groups = {pool: wait_for(lambda p=path: cluster.get(p), f"the {pool} LeaderWorkerSet", logs=operator.log)
              for pool, path in paths.items()}
    for pool, lws in groups.items():
        assert lws["metadata"]["ownerReferences"][0]["uid"] == isvc["metadata"]["uid"]
        assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
        assert cluster.deployment(f"{name}-{pool}") is None
        service = cluster.get(f"{collection('Service')}/{name}-{pool}")
        assert service["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
        assert cluster.get(f"{collection('NetworkPolicy')}/{name}-{pool}-group") is not None
        leader, worker = (lws["spec"]["leaderWorkerTemplate"][t]["spec"]["containers"][0]
                          for t in ("leaderTemplate", "workerTemplate"))
        assert "TESSERA_KV_REDIS_URL" in {e["name"] for e in leader["env"]}
        assert "TESSERA_KV_REDIS_URL" not in {e["name"] for e in worker["env"]}
        assert ("--kv-inbox-port" in leader["args"]) == (pool == "decode")
        assert not [a for a in worker["args"] if a.startswith("--kv-")] and "ports" not in worker

    cluster.set_ready(f"{name}-gateway", 1)
    for pool, path in paths.items():
        wanted = groups[pool]["spec"]["replicas"]
        cluster.patch(f"{path}/status", {"status": {"replicas": wanted, "readyReplicas": wanted,
                                                    "updatedReplicas": wanted}})
    up = wait_for(lambda: (c := cluster.condition(name)) and c["status"] == "True" and c, "Ready True",
                  logs=operator.log)
    assert up["reason"] == "AllComponentsReady"
    for pool, condition in (("prefill", "PrefillReady"), ("decode", "DecodeReady")):
        wanted = groups[pool]["spec"]["replicas"]
        assert cluster.condition(name, condition)["message"] == f"{wanted}/{wanted} groups ready"


def test_a_pipeline_parallel_pool_is_a_leader_worker_set_whose_ready_groups_make_it_ready(cluster, operator):
    """engine.pipelineParallelSize 2: a LeaderWorkerSet (owned, groups of 2), no engine Deployment, the
    pool's Service selecting leaders only; the LWS controller's status (ready groups) brings Ready."""
    body = example("mixed")  # with its host-memory KV tier: the leader holds it
    body["spec"].setdefault("engine", {})["pipelineParallelSize"] = 2
    name = body["metadata"]["name"]
    cluster.apply_isvc(body)
    isvc = applied(cluster, name)
    lws_path = f"{collection('LeaderWorkerSet')}/{name}-engine"
    lws = wait_for(lambda: cluster.get(lws_path), "the LeaderWorkerSet", logs=operator.log)
    assert lws["metadata"]["ownerReferences"][0]["uid"] == isvc["metadata"]["uid"]
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert lws["spec"]["replicas"] == isvc["status"]["pools"]["mixed"]["desiredReplicas"]
    assert cluster.deployment(f"{name}-engine") is None
    service = cluster.get(f"{collection('Service')}/{name}-engine")
    assert service["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    group = cluster.get(f"{collection('NetworkPolicy')}/{name}-engine-group")
    assert group["spec"]["ingress"][0]["ports"] == [{"protocol": "TCP"}]

    cluster.set_ready(f"{name}-gateway", 1)
    engine = wait_for(lambda: cluster.condition(name, "EngineReady"), "EngineReady")
    assert (engine["status"], engine["reason"]) == ("False", "NoReadyPods")
    # What the LWS controller would write: every group ready.
    wanted = lws["spec"]["replicas"]
    cluster.patch(f"{lws_path}/status", {"status": {"replicas": wanted, "readyReplicas": wanted,
                                                    "updatedReplicas": wanted}})
    up = wait_for(lambda: (c := cluster.condition(name)) and c["status"] == "True" and c, "Ready True",
                  logs=operator.log)
    assert up["reason"] == "AllComponentsReady"
    assert cluster.condition(name, "EngineReady")["message"] == f"{wanted}/{wanted} groups ready"
    assert cluster.isvc(name)["status"]["pools"]["mixed"]["readyReplicas"] == wanted

    leader, worker = (lws["spec"]["leaderWorkerTemplate"][t]["spec"]["containers"][0]["args"]
                      for t in ("leaderTemplate", "workerTemplate"))
    assert "--kv-host-bytes" in leader and "--kv-host-bytes" not in worker

    # Pipeline parallelism off: the LeaderWorkerSet and its group policy go, a Deployment comes.
    cluster.edit_isvc(name, {"spec": {"engine": {"pipelineParallelSize": 1}}})
    wait_for(lambda: cluster.deployment(f"{name}-engine") and cluster.get(lws_path) is None,
             "the Deployment back and the LeaderWorkerSet pruned", logs=operator.log)
    assert cluster.get(f"{collection('NetworkPolicy')}/{name}-engine-group") is None
