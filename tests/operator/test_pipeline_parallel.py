"""Pipeline-parallel pools (engine.pipelineParallelSize / pools.<role>.pipelineParallelSize above 1)
render as LeaderWorkerSets: one group of P pods per engine replica, the leader (stage 0) serving
gRPC, the workers the other stages. Checked against our own schema of the LeaderWorkerSet API
(lws_schema.py, not the upstream file) and the Kubernetes core schema for the pod templates, and
the containers' flags against the engine's own parser."""

from __future__ import annotations

import argparse
import copy

import jsonschema
import kopf
import kubernetes_validate
import pytest

from tessera_operator import validate_inference_service
from tessera_operator.engine_pool import MASTER_PORT, pod_selector
from tessera_operator.handlers import on_change, on_tick
from tessera_operator.names import Owner, selector_string
from tessera_operator.reconcile import ObjectKey, desired_objects, stale_keys, validated
from tessera_operator.status import component_condition

from .conftest import make_isvc
from .fake_cluster import FakeCluster, pod
from .lws_schema import LWS_SCHEMA, pod_template_object
from .test_handlers import ENGINE_METRICS, call, events, with_status  # noqa: F401 - events is a fixture
from .test_manifests import K8S_VERSIONS
from .test_network_policy import STRANGER, admits, policies_of
from .test_reconcile import by_key

PP2 = {"engine": {"pipelineParallelSize": 2}}
WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_NAME = "leaderworkerset.sigs.k8s.io/name"
# What the LWS controller puts in every pod of a group (the args reference them).
SAMPLE_ENV = {"LWS_LEADER_ADDRESS": "llama-engine-0.llama-engine-0.ml", "LWS_WORKER_INDEX": "1", "LWS_GROUP_SIZE": "2"}


def lws_of(objects: list[dict], name: str = "llama-engine") -> dict:
    return by_key(objects)[("LeaderWorkerSet", name)]


def templates(lws: dict) -> tuple[dict, dict]:
    t = lws["spec"]["leaderWorkerTemplate"]
    return t["leaderTemplate"], t["workerTemplate"]


def engine(template: dict) -> dict:
    (container,) = template["spec"]["containers"]
    return container


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion of container args from the container's environment."""
    out = []
    for arg in args:
        for name, value in env.items():
            arg = arg.replace(f"$({name})", value)
        assert "$(" not in arg, f"unexpanded variable in {arg!r}"
        out.append(arg)
    return out


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.fixture
def objects() -> list[dict]:
    return desired_objects(make_isvc({**PP2, "engine": {"pipelineParallelSize": 2, "tensorParallelSize": 2},
                                      "pools": {"mixed": {"replicas": 3}}}))


def test_a_pp_pool_is_a_leader_worker_set_instead_of_a_deployment(objects):
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert ("LeaderWorkerSet", "llama-engine") in kinds and ("Deployment", "llama-engine") not in kinds
    assert ("Deployment", "llama-gateway") in kinds  # the gateway stays a Deployment
    lws = lws_of(objects)
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert lws["spec"]["replicas"] == 3
    group = lws["spec"]["leaderWorkerTemplate"]
    assert (group["size"], group["restartPolicy"]) == (2, "RecreateGroupOnPodRestart")
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"
    # Owner reference and labels as the Deployments have.
    deployment = by_key(desired_objects(make_isvc()))[("Deployment", "llama-engine")]
    assert lws["metadata"]["ownerReferences"] == deployment["metadata"]["ownerReferences"]
    assert lws["metadata"]["labels"] == deployment["metadata"]["labels"]
    for template in templates(lws):
        assert template["metadata"]["labels"] == deployment["spec"]["template"]["metadata"]["labels"]
        # One pod per stage, each with the pool's tensor-parallel GPUs.
        assert engine(template)["resources"]["limits"]["nvidia.com/gpu"] == 2


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_the_leader_worker_set_passes_our_schema_of_the_lws_api_and_its_templates_the_core_schema(objects, version):
    lws = lws_of(objects)
    jsonschema.validate(lws, LWS_SCHEMA)
    for which, template in zip(("leader", "worker"), templates(lws)):
        kubernetes_validate.validate(pod_template_object(template, which), version, strict=True)
    # Everything else still passes the core schemas (the group's NetworkPolicy included).
    for obj in objects:
        if obj["kind"] != "LeaderWorkerSet":
            kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("breakage", ["misspelled field", "bad restart policy", "size 0", "no worker template",
                                      "a probe typo in a template"])
def test_the_schema_checks_have_teeth(objects, breakage):
    lws = copy.deepcopy(lws_of(objects))
    group = lws["spec"]["leaderWorkerTemplate"]
    if breakage == "a probe typo in a template":
        engine(group["leaderTemplate"])["readinessProbe"]["grcp"] = {"port": 1}
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(pod_template_object(group["leaderTemplate"], "leader"), "1.37.0", strict=True)
        return
    if breakage == "misspelled field":
        lws["spec"]["startupPolicyy"] = lws["spec"].pop("startupPolicy")
    elif breakage == "bad restart policy":
        group["restartPolicy"] = "Always"
    elif breakage == "size 0":
        group["size"] = 0
    else:
        del group["workerTemplate"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(lws, LWS_SCHEMA)


def test_the_pools_service_selects_leaders_only(objects):
    service = by_key(objects)[("Service", "llama-engine")]
    leader, worker = templates(lws_of(objects))
    assert service["spec"]["selector"][WORKER_INDEX] == "0"
    # The LWS controller labels the leader 0 and each worker its index: only the leader matches.
    leader_labels = {**leader["metadata"]["labels"], WORKER_INDEX: "0"}
    worker_labels = {**worker["metadata"]["labels"], WORKER_INDEX: "1"}
    assert all(leader_labels.get(k) == v for k, v in service["spec"]["selector"].items())
    assert not all(worker_labels.get(k) == v for k, v in service["spec"]["selector"].items())
    # A Deployment's Service has no such label (its pods do not carry it).
    plain = by_key(desired_objects(make_isvc()))[("Service", "llama-engine")]
    assert WORKER_INDEX not in plain["spec"]["selector"]


def test_leader_serves_and_is_probed_workers_run_stages_without_grpc_probes(objects):
    leader, worker = templates(lws_of(objects))
    lead, work = engine(leader), engine(worker)
    assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(lead)
    assert lead["readinessProbe"]["grpc"]["port"] == 50062
    assert not {"startupProbe", "readinessProbe", "livenessProbe"} & set(work)
    assert {p["name"] for p in lead["ports"]} >= {"grpc", "metrics", "health", "pp-master"}
    assert "ports" not in work
    # Only the leader has /metrics to scrape.
    assert "prometheus.io/scrape" in leader["metadata"]["annotations"]
    assert "annotations" not in worker["metadata"]
    # Ranks flags: node-rank 0 on the leader, the LWS worker index on workers; the leader's address.
    assert flag(lead["args"], "--node-rank") == "0"
    assert flag(work["args"], "--node-rank") == "$(LWS_WORKER_INDEX)"
    for args in (lead["args"], work["args"]):
        assert (flag(args, "--nnodes"), flag(args, "--pipeline-parallel-size")) == ("2", "2")
        assert flag(args, "--master-addr") == "$(LWS_LEADER_ADDRESS)"
        assert flag(args, "--master-port") == str(MASTER_PORT)
    # Same engine otherwise: the worker's flags are the leader's less its servers' (it serves nothing)
    # and its node rank.
    servers = {"--host", "--grpc-port", "--metrics-port", "--health-port"}
    assert not servers & set(work["args"])
    assert [a for i, a in enumerate(lead["args"]) if a not in servers and lead["args"][i - 1] not in servers
            and a != "0"] == [a for a in work["args"] if a != "$(LWS_WORKER_INDEX)"]


def test_the_internal_secret_reaches_every_pod_of_the_group_by_file_never_by_argument(objects):
    for template in templates(lws_of(objects)):
        container = engine(template)
        env = {e["name"]: e for e in container["env"]}
        assert env["TESSERA_INTERNAL_SECRET_FILE"]["value"].startswith("/")
        mounted = {m["mountPath"] for m in container["volumeMounts"]}
        assert any(env["TESSERA_INTERNAL_SECRET_FILE"]["value"].startswith(path) for path in mounted)
        assert not any("secret" in a.lower() for a in container["args"])


def _engine_parser() -> argparse.ArgumentParser:
    from engine_pod.server.main import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    return parser


def test_the_engines_parser_accepts_the_leader_and_worker_flags(objects, tmp_path, monkeypatch):
    """The engine's own argparse parser and its start-up checks (engine_pod/server/main.py), on the
    args with the LWS variables substituted as Kubernetes does."""
    from engine_pod.config import NodeLayout
    from engine_pod.entrypoints.cli_args import node_layout
    from engine_pod.server import main

    secret = tmp_path / "secret"
    secret.write_text("x" * 64)
    monkeypatch.setenv("TESSERA_INTERNAL_SECRET_FILE", str(secret))
    leader, worker = templates(lws_of(objects))
    parser = _engine_parser()
    for template, rank in ((leader, 0), (worker, 1)):
        args = parser.parse_args(expand(engine(template)["args"], SAMPLE_ENV))
        main._validate(args)
        assert (args.pipeline_parallel_size, args.tensor_parallel_size) == (2, 2)
        assert node_layout(args) == NodeLayout(2, rank, SAMPLE_ENV["LWS_LEADER_ADDRESS"], MASTER_PORT)
    assert NodeLayout.master_port == MASTER_PORT  # the engine's default is the operator's port


def test_a_pool_override_picks_the_pool_and_p1_stays_a_deployment():
    objects = desired_objects(make_isvc({"engine": {"pipelineParallelSize": 4},
                                         "pools": {"mixed": {"pipelineParallelSize": 1}}}))
    assert ("Deployment", "llama-engine") in by_key(objects)
    assert "--pipeline-parallel-size" not in by_key(objects)[("Deployment", "llama-engine")][
        "spec"]["template"]["spec"]["containers"][0]["args"]
    assert not any(o["kind"] == "LeaderWorkerSet" for o in objects)
    lws = lws_of(desired_objects(make_isvc({"pools": {"mixed": {"pipelineParallelSize": 3}}})))
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 3


def test_switching_pipeline_parallelism_off_prunes_the_leader_worker_set(objects):
    after = desired_objects(make_isvc())
    keys = [ObjectKey.of(o) for o in objects if o["kind"] in ("LeaderWorkerSet", "NetworkPolicy")]
    assert {(k.kind, k.name) for k in stale_keys(keys, after)} == {("LeaderWorkerSet", "llama-engine"),
                                                                   ("NetworkPolicy", "llama-engine-group")}


def test_the_group_admits_itself_on_every_tcp_port_and_nobody_else(objects):
    policies = policies_of(objects)
    leader, worker = templates(lws_of(objects))
    group_labels = {LWS_NAME: "llama-engine"}
    lead = {"labels": {**leader["metadata"]["labels"], **group_labels, WORKER_INDEX: "0"}, "namespace": "ml"}
    work = {"labels": {**worker["metadata"]["labels"], **group_labels, WORKER_INDEX: "1"}, "namespace": "ml"}
    gateway = {"labels": by_key(objects)[("Deployment", "llama-gateway")]["spec"]["template"]["metadata"]["labels"],
               "namespace": "ml"}
    for port in (MASTER_PORT, MASTER_PORT + 1, 41234):  # rendezvous, control channel, a gloo/NCCL port
        assert admits(policies, lead, work, port) and admits(policies, work, lead, port)
        assert not admits(policies, lead, STRANGER, port) and not admits(policies, lead, gateway, port)
    # Another InferenceService's group is no peer.
    other = {"labels": {**work["labels"], "tessera.dev/inference-service": "other", LWS_NAME: "other-engine"},
             "namespace": "ml"}
    assert not admits(policies, lead, other, MASTER_PORT)
    assert admits(policies, lead, gateway, 50061)  # the gateway still reaches the leader's gRPC


@pytest.mark.parametrize("change", [
    {**PP2, "kvStore": {"redis": {"urlSecretRef": {"name": "r"}}}},
    {**PP2, "kvStore": {"hostMemory": "8Gi"}},
    {"mode": "disaggregated", "kvStore": {"redis": {"urlSecretRef": {"name": "r"}}},
     "pools": {"prefill": {"pipelineParallelSize": 2}}},
], ids=["redis", "host memory", "disaggregated"])
def test_the_kv_store_and_disaggregation_under_pp_are_accepted(change):
    """The engine runs the KV store and P/D transfer under pipeline parallelism (the leader assembles
    whole blocks from every stage's share), so the CRD takes them (tests/operator/test_crd_cel.py
    checks the CEL side; test_pipeline_parallel_kv.py what each pod of a group gets)."""
    assert validate_inference_service(make_isvc(change))["spec"]


def test_loras_under_pp_are_accepted_and_every_pod_of_the_group_parses_the_lora_flags(tmp_path, monkeypatch):
    """LoRA runs under pipeline parallelism: the leader (the engine core) reads the adapters and
    sends them to every stage with the step, each stage writing its own layers' factors."""
    from engine_pod.server import main

    from .test_loras import LORA_SPEC, lora_modules

    secret = tmp_path / "secret"
    secret.write_text("x" * 64)
    monkeypatch.setenv("TESSERA_INTERNAL_SECRET_FILE", str(secret))
    spec = {**LORA_SPEC, "engine": {**LORA_SPEC["engine"], "pipelineParallelSize": 2}}
    leader, worker = templates(lws_of(desired_objects(make_isvc(spec))))
    parser = _engine_parser()
    for template in (leader, worker):
        args = expand(engine(template)["args"], SAMPLE_ENV)
        main._validate(parser.parse_args(args))
        assert "--enable-lora" in args and flag(args, "--max-loras") == "4"
    assert lora_modules(engine(leader)["args"])[0] == "sql=/models/adapters/sql"


def test_ready_follows_the_leader_worker_sets_ready_groups():
    lws = {"status": {"replicas": 2, "readyReplicas": 0}}
    assert not component_condition("EngineReady", lws, 2, "LeaderWorkerSet").ok
    lws["status"]["readyReplicas"] = 1
    condition = component_condition("EngineReady", lws, 2, "LeaderWorkerSet")
    assert condition.ok and condition.message == "1/2 groups ready"
    assert component_condition("EngineReady", None, 2, "LeaderWorkerSet").message == "LeaderWorkerSet not found"


def test_handlers_apply_the_lws_read_its_status_and_scale_its_groups(events):
    """The one replicas path: the autoscaler's decision lands in the LeaderWorkerSet's spec.replicas,
    observing the leaders only (a worker is no replica), and Ready follows its ready groups."""
    cluster = FakeCluster()
    memo = kopf.Memo(api=cluster, operator_namespace="tessera-system")
    body = make_isvc({**PP2, "pools": {"mixed": {"replicas": 1, "minReplicas": 1, "maxReplicas": 4}}})
    patch = call(on_change, body, cluster, memo=memo)
    assert ("get_workload", "LeaderWorkerSet", "llama-engine") in cluster.calls
    ready = {c["type"]: c["status"] for c in patch["status"]["conditions"]}
    assert ready["EngineReady"] == "False"
    body = with_status(body, patch)
    cluster.ready.update({"llama-engine": 1, "llama-gateway": 1})
    spec = validated(body)["spec"]
    leaders = selector_string(pod_selector(Owner.of(body), spec, "mixed"))
    assert leaders.endswith(f"{WORKER_INDEX}=0")
    cluster.pods[leaders] = [pod("llama-engine-0", "10.0.0.1")]
    cluster.metrics["10.0.0.1:9090"] = ENGINE_METRICS.format(waiting=40, running=32, kv=0.5)
    patch = call(on_tick, body, cluster, memo=memo)
    assert ("list_pods", leaders) in cluster.calls
    assert cluster.leader_worker_set("ml", "llama-engine")["spec"]["replicas"] > 1
    assert patch["status"]["pools"]["mixed"]["desiredReplicas"] > 1
    assert {c["type"]: c["status"] for c in patch["status"]["conditions"]}["Ready"] == "True"


def test_the_rendered_stream_names_the_secrets_the_group_pods_read():
    """`tessera render`'s header lists the Secrets of the LeaderWorkerSet's pod templates too."""
    from tessera_operator.render import secret_refs

    tls = {"secretName": "engine-tls", "serverName": "engine.ml"}
    objects = desired_objects(make_isvc({**PP2, "internalTLS": tls}))
    lws_only = [o for o in objects if o["kind"] == "LeaderWorkerSet"]
    assert {"llama-internal", "engine-tls"} <= set(secret_refs(lws_only))
