"""Workload and Service of one engine pool (mixed, prefill or decode).

The workload is a Deployment, or, when the pool's pipelineParallelSize P is above 1, a
LeaderWorkerSet (leaderworkerset.x-k8s.io/v1, the LWS controller must be installed): each
replica is a group of P pods, one pipeline stage each. The leader (worker index 0, stage 0)
runs the engine core: it serves gRPC, health and metrics as a Deployment's pod does and holds
the KV store (host tier, Redis, a decode pod's inbox), assembling whole blocks from every
stage's share. The workers (the other stages) run only their ranks: no port of their own, no
KV store flag, no Redis credential or certificate, the internal secret alone (the group's pods
authenticate each other with it), and the pool's memory less the host tier they do not hold.
The pool's Service selects leaders only, so the gateway, and through it a prefill pod pushing
KV, reaches them alone. A lost stage restarts its whole group (RecreateGroupOnPodRestart).
"""

from __future__ import annotations

import json
import math

from kubernetes.utils.quantity import parse_quantity

from kv_store.redis_tier import REDIS_URL_ENV  # the engine reads the Redis URL (password included) from it
from tessera_operator import batch, loras, names, pod_parts, secret_files
from tessera_operator.crd_spec import DIRECT_KV_CHANNEL
from tessera_operator.names import Owner
from tessera.tracing import ENGINE_SERVICE_NAME

GRPC_PORT = 50061
METRICS_PORT = 9090
# grpc.health.v1 alone, in plaintext: the kubelet's gRPC probes speak neither TLS nor the token.
HEALTH_PORT = 50062
# Pushed KV blocks, raw TCP (TLS under internalTLS): the direct P/D channel's data path, on decode
# pods with an inbox. gRPC's OpenKVInbox hands a prefill pod a one-time ticket for it. The engine
# refuses it on the port of --grpc-port, --metrics-port or --health-port.
KV_INBOX_PORT = 50063
# Triton writes its compiled kernels here (the root filesystem is read-only).
TRITON_CACHE_DIR = f"{pod_parts.TMP_MOUNT}/triton"
# A model may take minutes to load; the startup probe allows this long before liveness takes over.
STARTUP_SECONDS = 900
# Pipeline parallelism across pods: the LeaderWorkerSet API and the labels and variables its
# controller gives every pod of a group (the leader's worker index is 0).
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_LEADER_ADDRESS_ENV = "LWS_LEADER_ADDRESS"
LWS_WORKER_INDEX_ENV = "LWS_WORKER_INDEX"
# The leader's rendezvous port for the group's ranks (--master-port); the engine may also listen on
# the next one. gloo and NCCL then connect the ranks on ephemeral ports.
MASTER_PORT = 29500


def engine_args(owner: Owner, spec: dict, role: str) -> list[str]:
    """The `tessera engine` command line of one pool, as `tessera up` runs it too (`_pod_args` adds
    what only a pod has): the engine core's, which serves and holds the KV store. No credential is
    ever an argument: the Redis URL and the internal secret come by environment and file."""
    return _engine_command(owner, spec, role, core=True)


def stage_args(owner: Owner, spec: dict, role: str) -> list[str]:
    """The command line of a pipeline-parallel group's worker pod (node rank above 0, before
    `group_args`): the engine's, less what only the engine core uses, which runs in the leader alone.
    No server (gRPC, health, metrics: the worker serves nothing) and no KV store (host tier, Redis,
    inbox): the leader drives the worker's ranks over the node channel and assembles the whole
    blocks the store holds from every stage's share. The rest (model, parallelism, batch sizes,
    LoRA slots, speculative decoding) sizes the ranks, so it stays the leader's."""
    return _engine_command(owner, spec, role, core=False)


def _engine_command(owner: Owner, spec: dict, role: str, *, core: bool) -> list[str]:
    """`core`: the pod runs the engine core (a Deployment's pod, a group's leader)."""
    model, engine = spec["model"], spec["engine"]
    args = ["engine", "--model", pod_parts.model_path(model), "--role", role]
    if core:
        args += ["--host", "0.0.0.0", "--grpc-port", str(GRPC_PORT), "--metrics-port", str(METRICS_PORT)]
    args += ["--served-model-name", model["name"], "--dtype", model["dtype"]]
    if "maxModelLen" in model:
        args += ["--max-model-len", str(model["maxModelLen"])]
    args += ["--block-size", str(engine["blockSize"]),
             "--max-num-batched-tokens", str(engine["maxNumBatchedTokens"]),
             "--max-num-seqs", str(engine["maxNumSeqs"]),
             "--gpu-memory-utilization", str(engine["gpuMemoryUtilization"]),
             "--scheduling-policy", engine["schedulingPolicy"]]
    args += _background_args(spec)
    args += ["--tensor-parallel-size", str(pool_tensor_parallel_size(spec, role))]
    if pool_pipeline_parallel_size(spec, role) > 1:
        args += ["--pipeline-parallel-size", str(pool_pipeline_parallel_size(spec, role))]
    args += [
             "--drain-timeout", str(engine["drainTimeoutSeconds"]),
             "--step-timeout", str(engine["stepTimeoutSeconds"]),
             "--attention-backend", engine["attentionBackend"]]
    if "speculative" in engine:
        args += ["--speculative-config", speculative_config_json(engine["speculative"])]
    if not engine["prefixCaching"]:
        args.append("--no-prefix-caching")
    args += loras.engine_args(spec)
    if core:
        args += _kv_store_args(owner, spec) + _inbox_args(spec, role)
    return args


def _kv_store_args(owner: Owner, spec: dict) -> list[str]:
    """The KV store's tiers: the host-memory one, and Redis."""
    kv = spec["kvStore"]
    args = []
    host_bytes = _host_tier_bytes(spec)
    if host_bytes > 0:
        args += ["--kv-host-bytes", str(host_bytes)]
    if "redis" in kv:
        # The URL itself comes by environment (REDIS_URL_ENV); its own prefix gives each
        # InferenceService a key space a Redis ACL can confine it to.
        args += ["--kv-redis-key-prefix", names.redis_key_prefix(owner),
                 "--kv-redis-timeout", str(kv["redis"]["timeoutSeconds"])]
    return args


def _host_tier_bytes(spec: dict) -> int:
    """kvStore.hostMemory in bytes (0: no host tier), held in the engine core's process alone."""
    return int(parse_quantity(spec["kvStore"]["hostMemory"]))


def _background_args(spec: dict) -> list[str]:
    """Background (batch) work on idle capacity only: engine.backgroundPriority, or the batch class's
    priority with spec.batch (batch.background_priority)."""
    args = []
    priority = batch.background_priority(spec)
    if priority is not None:
        args += ["--background-priority", str(priority)]
    if "backgroundMaxBatchedTokens" in spec["engine"]:
        args += ["--background-max-batched-tokens", str(spec["engine"]["backgroundMaxBatchedTokens"])]
    return args


def _inbox_bytes(spec: dict, role: str) -> int | None:
    """The pool's inbox of pushed KV blocks, in bytes, or None where it has none. With the direct
    P/D channel, decode pods take prefill pods' pushes into an inbox. Only decode pods: the gateway
    splits requests only between a prefill and a decode pool."""
    disaggregation = spec["disaggregation"]
    if role != "decode" or disaggregation["kvChannel"] != DIRECT_KV_CHANNEL:
        return None
    return int(parse_quantity(disaggregation["inboxBytes"]))


def _listens_on_kv_inbox_port(spec: dict, role: str) -> bool:
    """Whether the pool's pods listen on KV_INBOX_PORT: an inbox of 0 refuses every push (its
    blocks go through Redis), and the engine takes no --kv-inbox-port without an inbox."""
    return (_inbox_bytes(spec, role) or 0) > 0


def _inbox_args(spec: dict, role: str) -> list[str]:
    inbox = _inbox_bytes(spec, role)
    if inbox is None:
        return []
    args = ["--kv-inbox-bytes", str(inbox)]
    if _listens_on_kv_inbox_port(spec, role):
        args += ["--kv-inbox-port", str(KV_INBOX_PORT)]
    return args


def _pod_args(spec: dict) -> list[str]:
    """Flags only a pod has: its probes' port and the Secret files mounted into it."""
    return (["--health-port", str(HEALTH_PORT)] + secret_files.engine_tls_args(spec)
            + secret_files.redis_tls_args(spec))


def group_args(spec: dict, role: str, node_rank: str) -> list[str]:
    """Flags of one pod of a pipeline-parallel group: one pod per stage, the ranks meeting at the
    leader's address (the LWS controller's variables, which Kubernetes expands in args)."""
    return ["--nnodes", str(pool_pipeline_parallel_size(spec, role)), "--node-rank", node_rank,
            "--master-addr", f"$({LWS_LEADER_ADDRESS_ENV})", "--master-port", str(MASTER_PORT)]


def speculative_config_json(speculative: dict) -> str:
    """The engine's `--speculative-config` (vLLM's snake_case keys)."""
    return json.dumps({
        "method": speculative["method"],
        "num_speculative_tokens": speculative["numSpeculativeTokens"],
        "prompt_lookup_min": speculative["promptLookupMin"],
        "prompt_lookup_max": speculative["promptLookupMax"],
    }, separators=(",", ":"))


def engine_env(spec: dict, core: bool = True) -> list[dict]:
    """The engine container's environment; the Redis URL (a credential) only where the engine core
    runs (`core`), the one process of a group that talks to Redis."""
    env = secret_files.internal_secret_env() + pod_parts.SCRATCH_ENV + [
        {"name": "TRITON_CACHE_DIR", "value": TRITON_CACHE_DIR}] + pod_parts.tracing_env(spec, ENGINE_SERVICE_NAME)
    redis = spec["kvStore"].get("redis")
    if redis is not None and core:
        ref = redis["urlSecretRef"]
        env.append({"name": REDIS_URL_ENV, "valueFrom": {"secretKeyRef": {"name": ref["name"], "key": ref["key"]}}})
    return env


def _secret_files(owner: Owner, spec: dict, core: bool) -> secret_files.SecretFiles:
    """The internal secret in every pod (a group's pods authenticate each other with it); the gRPC
    certificate and Redis's TLS files only where the engine core serves and reaches Redis."""
    files = secret_files.internal_secret(owner, spec)
    if core:
        files += secret_files.internal_tls(spec) + secret_files.redis_tls(spec)
    return files


def pool_tensor_parallel_size(spec: dict, role: str) -> int:
    """The pool's own tensorParallelSize, else the engine's."""
    return spec["pools"][role].get("tensorParallelSize", spec["engine"]["tensorParallelSize"])


def pool_pipeline_parallel_size(spec: dict, role: str) -> int:
    """The pool's own pipelineParallelSize, else the engine's: pods per group (1: a Deployment)."""
    return spec["pools"][role].get("pipelineParallelSize", spec["engine"]["pipelineParallelSize"])


def is_group_pool(spec: dict, role: str) -> bool:
    """Whether the pool runs as a LeaderWorkerSet (pipeline stages in pods of their own)."""
    return pool_pipeline_parallel_size(spec, role) > 1


def pool_gpus(spec: dict, role: str) -> int:
    pool = spec["pools"][role]
    return pool["gpus"] if "gpus" in pool else pool_tensor_parallel_size(spec, role)


def _probes() -> dict:
    grpc = {"grpc": {"port": HEALTH_PORT}}
    # The health service answers NOT_SERVING while the model loads and while draining.
    return {
        "startupProbe": {**grpc, "periodSeconds": 10, "timeoutSeconds": 5,
                         "failureThreshold": STARTUP_SECONDS // 10},
        "readinessProbe": {**grpc, "periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {**grpc, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6},
    }


def _container_ports(spec: dict, role: str) -> list[dict]:
    ports = [{"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
             {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
             {"name": "health", "containerPort": HEALTH_PORT, "protocol": "TCP"}]
    if _listens_on_kv_inbox_port(spec, role):
        ports.append({"name": "kv-inbox", "containerPort": KV_INBOX_PORT, "protocol": "TCP"})
    return ports


def _runs_core(node_rank: str | None) -> bool:
    """Whether the pod runs the engine core (scheduler, servers, KV store): a Deployment's pod
    (`node_rank` None) or a group's leader ("0"); a worker runs only its stage's ranks."""
    return node_rank in (None, "0")


def _pod_resources(spec: dict, role: str, core: bool) -> dict:
    """The requests and limits of one of the pool's pods (`core`: it runs the engine core). The pool's
    memory holds the process plus kvStore.hostMemory (its CRD description), and the host tier lives
    in the engine core's process alone: a group's worker reserves the same less the tier."""
    resources = spec["pools"][role]["resources"]
    return resources if core else _without_host_tier(resources, _host_tier_bytes(spec))


def _without_host_tier(resources: dict, host_bytes: int) -> dict:
    """`resources` with `host_bytes` taken off each memory figure (requests, limits). Where a figure
    cannot hold the tier, the pool's memory was not sized as the CRD says and the tier's share of
    it is unknown: every figure stays as it is (too much reserved, never too little; taking the
    same amount off both or neither keeps requests within limits)."""
    memory = {kind: parse_quantity(figures["memory"]) for kind, figures in resources.items()
              if "memory" in figures}
    if not host_bytes or not memory or min(memory.values()) <= host_bytes:
        return resources
    out = {kind: dict(figures) for kind, figures in resources.items()}
    for kind, figure in memory.items():
        out[kind]["memory"] = str(math.ceil(figure - host_bytes))  # whole bytes, rounded up
    return out


def _container(owner: Owner, spec: dict, role: str, node_rank: str | None = None) -> dict:
    """The engine container; `node_rank` in a pipeline-parallel group ("0": the leader, which serves
    and is probed as a Deployment's pod is; else a worker, which serves nothing, has no probe and
    gets nothing of the KV store)."""
    engine = spec["engine"]
    core = _runs_core(node_rank)
    args = (engine_args(owner, spec, role) + _pod_args(spec)) if core else stage_args(owner, spec, role)
    if node_rank is not None:
        args += group_args(spec, role, node_rank)
    ports = _container_ports(spec, role) if core else []
    if node_rank == "0":
        ports.append({"name": "pp-master", "containerPort": MASTER_PORT, "protocol": "TCP"})
    container = {
        "name": "engine",
        "image": spec["image"],
        "imagePullPolicy": spec["imagePullPolicy"],
        "command": ["tessera"],
        "args": args,
        **({"ports": ports} if ports else {}),
        "resources": pod_parts.resources(_pod_resources(spec, role, core), pool_gpus(spec, role),
                                         engine["gpuResourceName"]),
        **(_probes() if core else {}),
        "lifecycle": pod_parts.prestop_sleep(),
        "env": engine_env(spec, core),
        "securityContext": pod_parts.container_security_context(),
        "volumeMounts": [pod_parts.model_mount(), *loras.mounts(spec),
                         {"name": "dshm", "mountPath": "/dev/shm"}, pod_parts.tmp_mount(),
                         *_secret_files(owner, spec, core).mounts],
    }
    return container


def _pod_template(owner: Owner, spec: dict, role: str, node_rank: str | None = None) -> dict:
    pool = spec["pools"][role]
    pod_spec = {
        "securityContext": pod_parts.pod_security_context(),
        "containers": [_container(owner, spec, role, node_rank)],
        "terminationGracePeriodSeconds": pod_parts.termination_grace(spec["engine"]["drainTimeoutSeconds"]),
        # Engines need no API access and no Service env vars.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        # Tensor-parallel workers exchange tensors through shared memory; /tmp holds the
        # compiled kernels (torch extensions, triton).
        "volumes": [pod_parts.model_volume(spec["model"]), *loras.volumes(spec),
                    {"name": "dshm", "emptyDir": {"medium": "Memory"}}, pod_parts.tmp_volume(),
                    *_secret_files(owner, spec, _runs_core(node_rank)).volumes],
    }
    if pool.get("nodeSelector"):
        pod_spec["nodeSelector"] = dict(pool["nodeSelector"])
    if pool.get("tolerations"):
        pod_spec["tolerations"] = [dict(t) for t in pool["tolerations"]]
    metadata: dict = {"labels": names.labels(owner, "engine", role)}
    if _runs_core(node_rank):  # workers have no /metrics
        metadata["annotations"] = pod_parts.scrape_annotations(METRICS_PORT)
    return {"metadata": metadata, "spec": pod_spec}


def deployment(owner: Owner, spec: dict, role: str, replicas: int) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": pod_parts.object_meta(owner, names.pool_name(owner, role), names.labels(owner, "engine", role)),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": names.selector(owner, "engine", role)},
            # Never fewer serving pods during a rollout; one extra at a time (GPUs are scarce).
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": _pod_template(owner, spec, role),
        },
    }


def leader_worker_set(owner: Owner, spec: dict, role: str, replicas: int) -> dict:
    """A pipeline-parallel pool: `replicas` groups of P pods (P = the pool's pipelineParallelSize)."""
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": LWS_KIND,
        "metadata": pod_parts.object_meta(owner, names.pool_name(owner, role), names.labels(owner, "engine", role)),
        "spec": {
            "replicas": replicas,
            # Workers start with their leader; they wait for its rendezvous, not for it to be ready.
            "startupPolicy": "LeaderCreated",
            # As the Deployment's: one extra group at a time, never fewer serving.
            "rolloutStrategy": {"type": "RollingUpdate",
                                "rollingUpdateConfiguration": {"maxSurge": 1, "maxUnavailable": 0}},
            # The controller's headless Service (the leader's address, published before it is ready, which
            # the workers need to join it) one per group, LWS-NAME-INDEX: the Shared policy's would be named
            # like the LWS, the name of the pool's own Service, which selects ready leaders only.
            "networkConfig": {"subdomainPolicy": "UniquePerReplica"},
            "leaderWorkerTemplate": {
                "size": pool_pipeline_parallel_size(spec, role),
                # A lost stage fails the engine: the whole group restarts together.
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": _pod_template(owner, spec, role, "0"),
                "workerTemplate": _pod_template(owner, spec, role, f"$({LWS_WORKER_INDEX_ENV})"),
            },
        },
    }


def workload_kind(spec: dict, role: str) -> tuple[str, str]:
    """(apiVersion, kind) of the pool's workload."""
    return (LWS_API_VERSION, LWS_KIND) if is_group_pool(spec, role) else ("apps/v1", "Deployment")


def workload(owner: Owner, spec: dict, role: str, replicas: int) -> dict:
    """The pool's Deployment, or its LeaderWorkerSet under pipeline parallelism; `replicas` (pods, or
    groups) is what the autoscaler sets either way."""
    render = leader_worker_set if is_group_pool(spec, role) else deployment
    return render(owner, spec, role, replicas)


def pod_selector(owner: Owner, spec: dict, role: str) -> dict[str, str]:
    """The pool's serving pods: all of a Deployment's, the leaders of a LeaderWorkerSet's groups."""
    selector = names.selector(owner, "engine", role)
    if is_group_pool(spec, role):
        selector[LWS_WORKER_INDEX_LABEL] = "0"
    return selector


def service(owner: Owner, spec: dict, role: str) -> dict:
    """Headless: the gateway routes to individual pods found through the EndpointSlices (a
    LeaderWorkerSet's leaders only)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": pod_parts.object_meta(owner, names.pool_name(owner, role), names.labels(owner, "engine", role)),
        "spec": {
            "clusterIP": "None",
            "selector": pod_selector(owner, spec, role),
            "ports": [{"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc", "protocol": "TCP"},
                      {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"}],
        },
    }
