"""Deployment and Service of one engine pool (mixed, prefill or decode)."""

from __future__ import annotations

import json

from kubernetes.utils.quantity import parse_quantity

from tessera_operator import names, pod_parts
from tessera_operator.names import Owner

GRPC_PORT = 50061
METRICS_PORT = 9090
REDIS_URL_ENV = "TESSERA_KV_REDIS_URL"
# A model may take minutes to load; the startup probe allows this long before liveness takes over.
STARTUP_SECONDS = 900


def engine_args(spec: dict, role: str) -> list[str]:
    """The `tessera engine` command line for one pool's pods."""
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
             "--scheduling-policy", engine["schedulingPolicy"],
             "--tensor-parallel-size", str(engine["tensorParallelSize"]),
             "--drain-timeout", str(engine["drainTimeoutSeconds"]),
             "--attention-backend", engine["attentionBackend"]]
    if "speculative" in engine:
        args += ["--speculative-config", speculative_config_json(engine["speculative"])]
    if not engine["prefixCaching"]:
        args.append("--no-prefix-caching")
    host_bytes = int(parse_quantity(kv["hostMemory"]))
    if host_bytes > 0:
        args += ["--kv-host-bytes", str(host_bytes)]
    if "redis" in kv:
        # The kubelet expands $(VAR) from the container's env: the password stays in the Secret.
        args += ["--kv-redis-url", f"$({REDIS_URL_ENV})"]
    return args


def speculative_config_json(speculative: dict) -> str:
    """The engine's `--speculative-config` (vLLM's snake_case keys)."""
    return json.dumps({
        "method": speculative["method"],
        "num_speculative_tokens": speculative["numSpeculativeTokens"],
        "prompt_lookup_min": speculative["promptLookupMin"],
        "prompt_lookup_max": speculative["promptLookupMax"],
    }, separators=(",", ":"))


def engine_env(spec: dict) -> list[dict]:
    redis = spec["kvStore"].get("redis")
    if redis is None:
        return []
    ref = redis["urlSecretRef"]
    return [{"name": REDIS_URL_ENV, "valueFrom": {"secretKeyRef": {"name": ref["name"], "key": ref["key"]}}}]


def pool_gpus(spec: dict, role: str) -> int:
    pool = spec["pools"][role]
    return pool["gpus"] if "gpus" in pool else spec["engine"]["tensorParallelSize"]


def _probes() -> dict:
    grpc = {"grpc": {"port": GRPC_PORT}}
    # The health service answers NOT_SERVING while the model loads and while draining.
    return {
        "startupProbe": {**grpc, "periodSeconds": 10, "timeoutSeconds": 5,
                         "failureThreshold": STARTUP_SECONDS // 10},
        "readinessProbe": {**grpc, "periodSeconds": 5, "timeoutSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {**grpc, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 6},
    }


def _container(spec: dict, role: str) -> dict:
    engine = spec["engine"]
    container = {
        "name": "engine",
        "image": spec["image"],
        "imagePullPolicy": spec["imagePullPolicy"],
        "command": ["tessera"],
        "args": engine_args(spec, role),
        "ports": [{"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}],
        "resources": pod_parts.resources(spec["pools"][role]["resources"], pool_gpus(spec, role),
                                         engine["gpuResourceName"]),
        **_probes(),
        "lifecycle": pod_parts.prestop_sleep(),
        "volumeMounts": [pod_parts.model_mount(), {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    env = engine_env(spec)
    if env:
        container["env"] = env
    return container


def deployment(owner: Owner, spec: dict, role: str, replicas: int) -> dict:
    pool = spec["pools"][role]
    pod_spec = {
        "containers": [_container(spec, role)],
        "terminationGracePeriodSeconds": pod_parts.termination_grace(spec["engine"]["drainTimeoutSeconds"]),
        # Engines need no API access and no Service env vars.
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        # Tensor-parallel workers exchange tensors through shared memory.
        "volumes": [pod_parts.model_volume(spec["model"]), {"name": "dshm", "emptyDir": {"medium": "Memory"}}],
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
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
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
