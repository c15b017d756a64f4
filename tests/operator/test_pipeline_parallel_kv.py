"""Pipeline parallelism with the KV store and with disaggregation: a prefill and a decode pool, each a
LeaderWorkerSet of its own size (prefill P=2 x TP=2, decode P=2 x TP=1), with the host tier, Redis
(its URL from a Secret, TLS files from Secrets) and the direct P/D channel.

Only a group's leader runs the engine core (scheduler, gRPC, the KV store: it assembles whole blocks
from every stage's share and pushes or takes them), so only the leader gets what the core uses:
the KV store's flags, the Redis URL and its TLS files, the gRPC certificate, the inbox and its port,
the host tier's memory and a way into Redis (its NetworkPolicy). A worker gets its stage's ranks'
flags and the internal secret, nothing else. Checked against the
LeaderWorkerSet and core schemas, the NetworkPolicy evaluator, and the engine's own parser."""

from __future__ import annotations

import jsonschema
import kubernetes_validate
import pytest
from kubernetes.utils.quantity import parse_quantity

from tessera_operator import InvalidInferenceService, validate_inference_service
from tessera_operator.engine_pool import KV_INBOX_PORT, MASTER_PORT
from tessera_operator.reconcile import desired_objects
from tessera_operator.render import secret_refs

from .conftest import deep_merge, make_isvc
from .lws_schema import LWS_SCHEMA, pod_template_object
from .test_manifests import K8S_VERSIONS
from .test_batch import CLASSES as BATCH_CLASSES
from .test_network_policy import REDIS as REDIS_POD
from .test_network_policy import STRANGER, admits, pod_of, policies_of
from .test_pipeline_parallel import LWS_NAME, WORKER_INDEX, _engine_parser, engine, expand, flag, lws_of, templates
from .test_reconcile import by_key

REDIS_URL_ENV = "TESSERA_KV_REDIS_URL"
REDIS = {"urlSecretRef": {"name": "tessera-redis"}, "podSelector": {"app": "redis"},
         "tls": {"caSecretRef": {"name": "redis-ca"}, "clientCertSecretRef": {"name": "redis-client"}}}
PD_PP = {
    "mode": "disaggregated",
    "pools": {"prefill": {"pipelineParallelSize": 2, "tensorParallelSize": 2},
              "decode": {"pipelineParallelSize": 2, "tensorParallelSize": 1, "replicas": 2}},
    "kvStore": {"hostMemory": "8Gi", "redis": REDIS},
    "disaggregation": {"kvChannel": "direct", "inboxBytes": "2Gi"},
    "internalTLS": {"secretName": "engine-tls", "serverName": "engine.ml"},
}
# pool -> (pipeline, tensor parallel size)
LAYOUT = {"prefill": (2, 2), "decode": (2, 1)}
# What only the engine core's process reads: its servers, their TLS, the KV store.
SERVER_FLAGS = {"--host", "--grpc-port", "--metrics-port", "--health-port"}
CORE_FLAG_PREFIXES = ("--kv-", "--tls-")
# The Secrets only the leaders need (the Redis URL, Redis's TLS files, the gRPC certificate).
CORE_SECRETS = {"tessera-redis", "redis-ca", "redis-client", "engine-tls"}


@pytest.fixture(scope="module")
def objects() -> list[dict]:
    return _render(PD_PP)


def _render(change: dict) -> list[dict]:
    return desired_objects(make_isvc(change))


def _lws(objects: list[dict], pool: str) -> dict:
    return lws_of(objects, f"llama-{pool}")


def _pods(objects: list[dict], pool: str) -> dict[str, dict]:
    """The pool's leader and worker as the NetworkPolicy evaluator sees them (the LWS controller's labels)."""
    leader, worker = templates(_lws(objects, pool))
    group = {LWS_NAME: f"llama-{pool}"}
    return {"leader": {"labels": {**leader["metadata"]["labels"], **group, WORKER_INDEX: "0"}, "namespace": "ml"},
            "worker": {"labels": {**worker["metadata"]["labels"], **group, WORKER_INDEX: "1"}, "namespace": "ml"}}


def test_the_formerly_refused_resource_is_valid():
    """The KV store and disaggregated mode under pipeline parallelism: the CRD no longer refuses them."""
    spec = validate_inference_service(make_isvc(PD_PP))["spec"]
    assert spec["mode"] == "disaggregated" and "redis" in spec["kvStore"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_each_pool_is_a_leader_worker_set_of_its_own_layout_and_passes_the_schemas(objects, version):
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert not {("Deployment", "llama-prefill"), ("Deployment", "llama-decode")} & kinds
    for pool, (pp, tp) in LAYOUT.items():
        lws = _lws(objects, pool)
        jsonschema.validate(lws, LWS_SCHEMA)
        assert lws["spec"]["leaderWorkerTemplate"]["size"] == pp
        for which, template in zip(("leader", "worker"), templates(lws)):
            kubernetes_validate.validate(pod_template_object(template, which), version, strict=True)
            assert engine(template)["resources"]["limits"]["nvidia.com/gpu"] == tp
    assert _lws(objects, "decode")["spec"]["replicas"] == 2
    for obj in objects:
        if obj["kind"] != "LeaderWorkerSet":
            kubernetes_validate.validate(obj, version, strict=True)


def test_leaders_get_the_kv_store_the_redis_credential_and_the_decode_inbox(objects):
    for pool in LAYOUT:
        leader = engine(templates(_lws(objects, pool))[0])
        args = leader["args"]
        assert flag(args, "--kv-host-bytes") == str(int(parse_quantity("8Gi")))
        assert flag(args, "--kv-redis-key-prefix") == "tessera:ml/llama:"
        assert flag(args, "--kv-redis-ca-file").startswith("/") and flag(args, "--kv-redis-cert-file")
        assert flag(args, "--tls-cert-file").startswith("/")
        env = {e["name"]: e for e in leader["env"]}
        assert env[REDIS_URL_ENV]["valueFrom"]["secretKeyRef"] == {"name": "tessera-redis", "key": "url"}
        ports = {p["name"]: p["containerPort"] for p in leader["ports"]}
        assert {"grpc", "metrics", "health", "pp-master"} <= set(ports)
        if pool == "decode":  # the direct channel's inbox: decode leaders take the pushes
            assert (flag(args, "--kv-inbox-bytes"), flag(args, "--kv-inbox-port")) == (str(2 * 2**30), "50063")
            assert ports["kv-inbox"] == KV_INBOX_PORT
        else:
            assert "--kv-inbox-port" not in args and "kv-inbox" not in ports
    leaders = [o for o in objects if o["kind"] == "LeaderWorkerSet"]
    assert CORE_SECRETS | {"llama-internal"} <= set(secret_refs(leaders))


def test_workers_get_their_stage_and_the_internal_secret_nothing_of_the_engine_core(objects):
    for pool, (pp, tp) in LAYOUT.items():
        leader, worker = templates(_lws(objects, pool))
        work = engine(worker)
        args = work["args"]
        assert not [a for a in args if a.startswith(CORE_FLAG_PREFIXES) or a in SERVER_FLAGS]
        assert "ports" not in work  # nothing listens there but the group's own ranks
        assert (flag(args, "--pipeline-parallel-size"), flag(args, "--tensor-parallel-size")) == (str(pp), str(tp))
        assert flag(args, "--node-rank") == "$(LWS_WORKER_INDEX)"
        env = {e["name"] for e in work["env"]}
        assert REDIS_URL_ENV not in env and "TESSERA_INTERNAL_SECRET_FILE" in env
        # The one Secret a worker reads: the internal secret, by file.
        worker_pod = {"kind": "Deployment", "spec": {"template": worker}}
        assert secret_refs([worker_pod]) == ["llama-internal"]
        mounts = {m["name"] for m in work["volumeMounts"]}
        volumes = {v["name"] for v in worker["spec"]["volumes"]}
        assert mounts <= volumes and "internal-secret" in mounts
        # Otherwise the leader's engine: the worker's flags are the leader's, less the core's.
        assert _stage_flags(engine(leader)["args"]) == [a for a in args if a != "$(LWS_WORKER_INDEX)"]


def _stage_flags(leader_args: list[str]) -> list[str]:
    """The leader's flags without the engine core's (each of those takes a value) and its node rank."""
    out, skip = [], False
    for arg in leader_args:
        if skip:
            skip = False
        elif arg in SERVER_FLAGS or arg.startswith(CORE_FLAG_PREFIXES):
            skip = True
        elif arg != "0":
            out.append(arg)
    return out


def _pod_env(container: dict) -> dict[str, str]:
    """The container's environment as the kubelet would set it (a Secret's value made up)."""
    return {e["name"]: e.get("value", "redis://:pw@redis.ml:6379/0") for e in container["env"]}


def test_the_engines_parser_accepts_every_pods_flags_and_only_leaders_configure_the_kv_store(
        objects, tmp_path, monkeypatch):
    """The engine's argparse parser and start-up checks (engine_pod/server/main.py) on each pod's args
    with the LWS variables substituted; engine_kwargs on each pod's own environment: the KV store
    the process would configure (the leader's tiers and inbox; none on a worker)."""
    from engine_pod.config import NodeLayout
    from engine_pod.entrypoints.cli_args import engine_kwargs, node_layout
    from engine_pod.server import main

    secret = tmp_path / "secret"
    secret.write_text("x" * 64)
    parser = _engine_parser()
    for pool, (pp, tp) in LAYOUT.items():
        leader_address = f"llama-{pool}-0.llama-{pool}-0.ml"
        for rank, template in enumerate(templates(_lws(objects, pool))):
            container = engine(template)
            env = {**_pod_env(container), "TESSERA_INTERNAL_SECRET_FILE": str(secret),
                   "LWS_LEADER_ADDRESS": leader_address, "LWS_WORKER_INDEX": str(rank), "LWS_GROUP_SIZE": str(pp)}
            monkeypatch.delenv(REDIS_URL_ENV, raising=False)
            for name, value in env.items():
                monkeypatch.setenv(name, value)
            args = parser.parse_args(expand(container["args"], env))
            main._validate(args)
            assert (args.pipeline_parallel_size, args.tensor_parallel_size) == (pp, tp)
            assert node_layout(args) == NodeLayout(pp, rank, leader_address, MASTER_PORT)
            kw = engine_kwargs(args)
            kv = (kw["kv_host_bytes"], kw["kv_redis_url"] is not None, kw["kv_inbox_bytes"], args.kv_inbox_port)
            if rank:
                assert kv == (0, False, 0, 0), f"{pool} worker"
            else:
                inbox = (2 * 2**30, KV_INBOX_PORT) if pool == "decode" else (0, 0)
                assert kv == (8 * 2**30, True, *inbox), f"{pool} leader"


def test_prefill_leaders_reach_decode_leaders_inbox_and_groups_stay_internal(objects):
    policies = policies_of(objects)
    prefill, decode = _pods(objects, "prefill"), _pods(objects, "decode")
    gateway = {"labels": by_key(objects)[("Deployment", "llama-gateway")]["spec"]["template"]["metadata"]["labels"],
               "namespace": "ml"}
    # The direct channel: the ticket over gRPC, then the blocks on the inbox port, leader to leader.
    assert admits(policies, decode["leader"], prefill["leader"], 50061)
    assert admits(policies, decode["leader"], prefill["leader"], KV_INBOX_PORT)
    # Only the prefill leaders push: their workers, the gateway and strangers get no inbox (the decode
    # group's own workers reach every port of their leader: the group policy, for gloo and NCCL).
    for source in (prefill["worker"], gateway, STRANGER):
        assert not admits(policies, decode["leader"], source, KV_INBOX_PORT)
    assert admits(policies, decode["leader"], gateway, 50061)  # routing and the decode half
    # Each group's pods admit each other on any port (rendezvous, node channel, gloo/NCCL), no one else.
    for pool, pods in (("prefill", prefill), ("decode", decode)):
        other = decode if pool == "prefill" else prefill
        for port in (MASTER_PORT, MASTER_PORT + 1, 41234):
            assert admits(policies, pods["leader"], pods["worker"], port), pool
            assert admits(policies, pods["worker"], pods["leader"], port), pool
            assert not admits(policies, pods["worker"], other["leader"], port), pool
            assert not admits(policies, pods["worker"], STRANGER, port), pool


def test_the_gateway_finds_leaders_only_so_pushes_go_to_leaders(objects):
    """The gateway discovers decode pods through the pool's Service and sends their address to the
    prefill pod, which pushes to that host: leaders only, as the Service selects them."""
    import yaml

    config = yaml.safe_load(by_key(objects)[("ConfigMap", "llama-gateway")]["data"]["gateway.yaml"])
    assert config["pods"]["kubernetes"]["services"] == {"prefill": "llama-prefill", "decode": "llama-decode"}
    for pool in LAYOUT:
        service = by_key(objects)[("Service", f"llama-{pool}")]
        pods = _pods(objects, pool)
        selects = [all(p["labels"].get(k) == v for k, v in service["spec"]["selector"].items())
                   for p in (pods["leader"], pods["worker"])]
        assert selects == [True, False], pool


def test_a_mixed_pool_with_the_kv_store_gives_it_to_the_leader_alone():
    """The same split without disaggregation: engine.pipelineParallelSize 2 with host memory and Redis."""
    objects = _render({"engine": {"pipelineParallelSize": 2}, "kvStore": {"hostMemory": "1Gi", "redis": REDIS}})
    leader, worker = (engine(t) for t in templates(lws_of(objects)))
    assert "--kv-host-bytes" in leader["args"] and "--kv-redis-key-prefix" in leader["args"]
    assert not [a for a in worker["args"] if a.startswith("--kv-")]
    assert REDIS_URL_ENV in {e["name"] for e in leader["env"]}
    assert REDIS_URL_ENV not in {e["name"] for e in worker["env"]}


def test_redis_admits_the_pools_serving_pods_not_the_workers():
    """Only the engine core talks to Redis (workers get no URL), so kvStore.redis.podSelector's policy
    admits a pipeline-parallel pool's leaders, not its workers; a Deployment's pods and the gateway
    (with batch.redis) stay admitted, here beside a pipeline-parallel prefill pool."""
    both = _render(PD_PP)
    for pool in LAYOUT:
        pods = _pods(both, pool)
        assert admits(policies_of(both), REDIS_POD, pods["leader"], 6379), pool
        assert not admits(policies_of(both), REDIS_POD, pods["worker"], 6379), pool
    prefill_only = _render({**PD_PP, "pools": {"prefill": {"pipelineParallelSize": 2}, "decode": {}},
                            "gateway": BATCH_CLASSES, "batch": {"redis": {"urlSecretRef": {"name": "batch-redis"}}}})
    policies, prefill = policies_of(prefill_only), _pods(prefill_only, "prefill")
    assert ("Deployment", "llama-decode") in by_key(prefill_only)
    for source in (prefill["leader"], pod_of(prefill_only, "llama-decode"), pod_of(prefill_only, "llama-gateway")):
        assert admits(policies, REDIS_POD, source, 6379), source
    for source in (prefill["worker"], STRANGER):
        assert not admits(policies, REDIS_POD, source, 6379), source


POOL_RESOURCES = {"requests": {"cpu": "4", "memory": "24Gi"}, "limits": {"memory": "40Gi"}}


def _memory(template: dict) -> dict[str, int]:
    resources = engine(template)["resources"]
    return {kind: int(parse_quantity(resources[kind]["memory"])) for kind in ("requests", "limits")}


def test_workers_reserve_the_pools_memory_less_the_host_tier_the_leader_all_of_it():
    """The pool's memory holds the process plus kvStore.hostMemory (8Gi), and only the leader's engine
    core holds the host tier: the leader gets the pool's figures, each worker 8Gi less on both."""
    objects = _render(deep_merge(PD_PP, {"pools": {pool: {"resources": POOL_RESOURCES} for pool in LAYOUT}}))
    for pool in LAYOUT:
        leader, worker = templates(_lws(objects, pool))
        assert _memory(leader) == {"requests": 24 * 2**30, "limits": 40 * 2**30}, pool
        assert _memory(worker) == {"requests": 16 * 2**30, "limits": 32 * 2**30}, pool
        assert engine(worker)["resources"]["requests"]["cpu"] == "4"
        kubernetes_validate.validate(pod_template_object(worker, "worker"), K8S_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("host_memory, resources", [
    ("0", POOL_RESOURCES),  # no host tier: nothing to take off
    ("32Gi", POOL_RESOURCES),  # requests cannot hold the tier: the sizing is not the CRD's, keep it
    ("8Gi", {"requests": {"cpu": "4"}}),  # no memory figure at all
], ids=["no host tier", "memory smaller than the tier", "no memory"])
def test_workers_keep_the_pools_resources_where_no_host_tier_share_is_known(host_memory, resources):
    objects = _render({"engine": {"pipelineParallelSize": 2}, "kvStore": {"hostMemory": host_memory},
                       "pools": {"mixed": {"resources": resources}}})
    leader, worker = (engine(t)["resources"] for t in templates(lws_of(objects)))
    assert worker == leader and leader["requests"] == {**resources["requests"], "nvidia.com/gpu": 1}


@pytest.mark.parametrize("pools", [{"prefill": 2, "decode": 2}, {"prefill": 1, "decode": 2}, {"mixed": 2}])
def test_the_longest_name_allowed_keeps_every_group_pods_labels_within_63_characters(pools):
    """The LWS controller names each group's worker StatefulSet LWS-GROUP, and a StatefulSet labels its
    pods with its name plus a hash (controller-revision-hash: NAME-HASH, 11 characters more); a
    label value stops at 63. With the longest name the CRD takes, group 9999's label still fits, and
    one character more is refused."""
    mode = "mixed" if "mixed" in pools else "disaggregated"
    change = {"mode": mode, "pools": {pool: {"pipelineParallelSize": p} for pool, p in pools.items()}}
    longest = max(n for n in range(30, 51) if _valid(make_isvc(change, name="a" * n)))
    for obj in desired_objects(make_isvc(change, name="a" * longest)):
        if obj["kind"] == "LeaderWorkerSet":
            assert len(f"{obj['metadata']['name']}-9999") + 11 <= 63, obj["metadata"]["name"]
    assert longest == (39 if pools.get("prefill", 1) > 1 else 40)
    with pytest.raises(InvalidInferenceService, match="metadata.name must have at most"):
        validate_inference_service(make_isvc(change, name="a" * (longest + 1)))


def _valid(body: dict) -> bool:
    try:
        validate_inference_service(body)
    except InvalidInferenceService:
        return False
    return True
