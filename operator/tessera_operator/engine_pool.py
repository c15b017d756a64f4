"""Deployment and Service of one engine pool (mixed, prefill or decode)."""

from __future__ import annotations

import json

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


def engine_args(owner: Owner, spec: dict, role: str) -> list[str]:
    """The `tessera engine` command line of one pool, as `tessera up` runs it too (`_pod_args` adds
    what only a pod has). No credential is ever an argument: the Redis URL and the internal secret
    come by environment and file."""
    model, engine, kv = spec["model"], spec["engine"], spec["kvStore"]
    args = ["engine", "--model", pod_parts.model_path(model), "--role", role,
            "--host", "0.0.0.0", "--grpc-port", str(GRPC_PORT), "--metrics-port", str(METRICS_PORT),
            "--served-model-name", model["name"], "--dtype", model["dtype"]]
    if "maxModelLen" in model:
        args += ["--max-model-len", str(model["maxModelLen"])]
    args += ["--block-size", str(engine["blockSize"]),
             "--max-num-batched-tokens", str(engine["maxNumBatchedTokens"]),
             "--max-num-seqs", str(engine["maxNumSeqs"]),
             "--gpu-memory-utilization", str(engine["gpuMemoryUtilization"]),
             "--scheduling-policy", engine["schedulingPolicy"]]
    args += _background_args(spec)
    args += ["--tensor-parallel-size", str(pool_tensor_parallel_size(spec, role)),
             "--drain-timeout", str(engine["drainTimeoutSeconds"]),
             "--step-timeout", str(engine["stepTimeoutSeconds"]),
             "--attention-backend", engine["attentionBackend"]]
    if "speculative" in engine:
        args += ["--speculative-config", speculative_config_json(engine["speculative"])]
    if not engine["prefixCaching"]:
        args.append("--no-prefix-caching")
    args += loras.engine_args(spec)
    host_bytes = int(parse_quantity(kv["hostMemory"]))
    if host_bytes > 0:
        args += ["--kv-host-bytes", str(host_bytes)]
    if "redis" in kv:
        # The URL itself comes by environment (REDIS_URL_ENV); its own prefix gives each
        # InferenceService a key space a Redis ACL can confine it to.
        args += ["--kv-redis-key-prefix", names.redis_key_prefix(owner),
                 "--kv-redis-timeout", str(kv["redis"]["timeoutSeconds"])]
    return args + _inbox_args(spec, role)


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


def speculative_config_json(speculative: dict) -> str:
    """The engine's `--speculative-config` (vLLM's snake_case keys)."""
    return json.dumps({
        "method": speculative["method"],
        "num_speculative_tokens": speculative["numSpeculativeTokens"],
        "prompt_lookup_min": speculative["promptLookupMin"],
        "prompt_lookup_max": speculative["promptLookupMax"],
    }, separators=(",", ":"))


def engine_env(spec: dict) -> list[dict]:
    env = secret_files.internal_secret_env() + pod_parts.SCRATCH_ENV + [
        {"name": "TRITON_CACHE_DIR", "value": TRITON_CACHE_DIR}] + pod_parts.tracing_env(spec, ENGINE_SERVICE_NAME)
    redis = spec["kvStore"].get("redis")
    if redis is not None:
        ref = redis["urlSecretRef"]
        env.append({"name": REDIS_URL_ENV, "valueFrom": {"secretKeyRef": {"name": ref["name"], "key": ref["key"]}}})
    return env


def _secret_files(owner: Owner, spec: dict) -> secret_files.SecretFiles:
    return (secret_files.internal_secret(owner, spec) + secret_files.internal_tls(spec)
            + secret_files.redis_tls(spec))


def pool_tensor_parallel_size(spec: dict, role: str) -> int:
    """The pool's own tensorParallelSize, else the engine's."""
    return spec["pools"][role].get("tensorParallelSize", spec["engine"]["tensorParallelSize"])


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


def _container(owner: Owner, spec: dict, role: str) -> dict:
    engine = spec["engine"]
    container = {
        "name": "engine",
        "image": spec["image"],
        "imagePullPolicy": spec["imagePullPolicy"],
        "command": ["tessera"],
        "args": engine_args(owner, spec, role) + _pod_args(spec),
        "ports": _container_ports(spec, role),
        "resources": pod_parts.resources(spec["pools"][role]["resources"], pool_gpus(spec, role),
                                         engine["gpuResourceName"]),
        **_probes(),
        "lifecycle": pod_parts.prestop_sleep(),
        "env": engine_env(spec),
        "securityContext": pod_parts.container_security_context(),
        "volumeMounts": [pod_parts.model_mount(), *loras.mounts(spec),
                         {"name": "dshm", "mountPath": "/dev/shm"}, pod_parts.tmp_mount(),
                         *_secret_files(owner, spec).mounts],
    }
    return container


def deployment(owner: Owner, spec: dict, role: str, replicas: int) -> dict:
    pool = spec["pools"][role]
    pod_spec = {
        "securityContext": pod_parts.pod_security_context(),
        "containers": [_container(owner, spec, role)],
        "terminationGracePeriodSeconds": pod_parts.termination_grace(spec["engine"]["drainTimeoutSeconds"]),
        # Engines need no API access and no Service env vars.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        # Tensor-parallel workers exchange tensors through shared memory; /tmp holds the
        # compiled kernels (torch extensions, triton).
        "volumes": [pod_parts.model_volume(spec["model"]), *loras.volumes(spec),
                    {"name": "dshm", "emptyDir": {"medium": "Memory"}}, pod_parts.tmp_volume(),
                    *_secret_files(owner, spec).volumes],
    }
    if pool.get("nodeSelector"):
        pod_spec["nodeSelector"] = dict(pool["nodeSelector"])
    if pool.get("tolerations"):
        pod_spec["tolerations"] = [dict(t) for t in pool["tolerations"]]
    labels = names.labels(owner, "engine", role)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": pod_parts.object_meta(owner, names.pool_name(owner, role), labels),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": names.selector(owner, "engine", role)},
            # Never fewer serving pods during a rollout; one extra at a time (GPUs are scarce).
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {"metadata": {"labels": labels, "annotations": pod_parts.scrape_annotations(METRICS_PORT)},
                         "spec": pod_spec},
        },
    }


def service(owner: Owner, role: str) -> dict:
    """Headless: the gateway routes to individual pods found through the EndpointSlices."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": pod_parts.object_meta(owner, names.pool_name(owner, role), names.labels(owner, "engine", role)),
        "spec": {
            "clusterIP": "None",
            "selector": names.selector(owner, "engine", role),
            "ports": [{"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc", "protocol": "TCP"},
                      {"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"}],
        },
    }
