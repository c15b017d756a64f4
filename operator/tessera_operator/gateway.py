"""The gateway's config file, ConfigMap, Deployment, Service and discovery RBAC."""

from __future__ import annotations

import hashlib

import yaml

from tessera_operator import batch, loras, names, pod_parts, secret_files
from tessera_operator.crd_spec import DEFAULT_CONTROL_PLANE_IMAGE, DEFAULT_IMAGE
from tessera_operator.names import Owner
from tessera.tracing import GATEWAY_SERVICE_NAME

HTTP_PORT = 8000
GRPC_PORT = 50051
# /metrics names every tenant: it is served here, off the public ports, and the Service leaves it out.
METRICS_PORT = 9090
CONFIG_DIR = "/etc/tessera/gateway"
CONFIG_FILE = "gateway.yaml"
TENANTS_DIR = "/etc/tessera/tenants"
TENANTS_KEY = "tenants.yaml"


def gateway_config(owner: Owner, spec: dict) -> dict:
    """The gateway.yaml the gateway reads (`tessera gateway --config`)."""
    gw = spec["gateway"]
    config = {
        "model": {
            "name": spec["model"]["name"],
            "path": pod_parts.model_path(spec["model"]),
            "max_model_len": spec["model"].get("maxModelLen"),
            "block_size": spec["engine"]["blockSize"],
            "tool_call_parser": spec["model"].get("toolCallParser"),
        },
        "server": {"host": "0.0.0.0", "http_port": HTTP_PORT, "grpc_port": GRPC_PORT, "metrics_port": METRICS_PORT},
        "pods": {"kubernetes": {
            "namespace": owner.namespace,
            "port_name": "grpc",
            "services": {role: names.pool_name(owner, role) for role in names.active_pools(spec["mode"])},
        }},
    }
    if spec.get("loras"):
        # Names only: the gateway lists them in /v1/models and routes by them; the pods hold the folders.
        config["model"]["loras"] = loras.gateway_loras(spec)
    if "tenantsSecretRef" in gw:
        config["tenants_file"] = f"{TENANTS_DIR}/{TENANTS_KEY}"
    config["priority_classes"] = [
        {"name": c["name"], "priority": c["priority"], "weight": c["weight"], "sheddable": c["sheddable"]}
        for c in gw["priorityClasses"]
    ]
    config["default_priority_class"] = gw["defaultPriorityClass"]
    disaggregation = spec["disaggregation"]
    config["disaggregation"] = {"min_uncached_tokens": disaggregation["minUncachedTokens"],
                                "kv_channel": disaggregation["kvChannel"]}
    if any(spec["pools"][role]["minReplicas"] == 0 for role in names.active_pools(spec["mode"])):
        # A pool may be at zero pods: requests wait in the gateway's queue,
        # whose length lifts the pool from zero (autoscale.py).
        config["admission"] = {"queue_without_pods": True}
    tls = secret_files.gateway_tls_config(spec)
    if tls:
        config["internal"] = {"tls": tls}
    batch_config = batch.gateway_section(owner, spec)
    if batch_config is not None:
        config["batch"] = batch_config
    return config


def config_text(owner: Owner, spec: dict) -> str:
    return yaml.safe_dump(gateway_config(owner, spec), sort_keys=False)


def config_map(owner: Owner, spec: dict) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": pod_parts.object_meta(owner, names.gateway_name(owner), names.labels(owner, "gateway")),
        "data": {CONFIG_FILE: config_text(owner, spec)},
    }


def image(spec: dict) -> str:
    """spec.gateway.image; absent, the slim control-plane image beside the default engine image, else
    spec.image: a custom engine image (a mirror, a build of one's own) holds the gateway too and keeps
    serving both, as before the two images."""
    if "image" in spec["gateway"]:
        return spec["gateway"]["image"]
    return DEFAULT_CONTROL_PLANE_IMAGE if spec["image"] == DEFAULT_IMAGE else spec["image"]


def _probe(path: str, period: int, failures: int) -> dict:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period, "timeoutSeconds": 3,
            "failureThreshold": failures}


def _volumes(spec: dict, owner: Owner) -> tuple[list[dict], list[dict]]:
    volumes = [pod_parts.model_volume(spec["model"]),
               {"name": "config", "configMap": {"name": names.gateway_name(owner)}}, pod_parts.tmp_volume()]
    mounts = [pod_parts.model_mount(), {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
              pod_parts.tmp_mount()]
    files = secret_files.internal_secret(owner, spec) + secret_files.internal_tls(spec)
    tenants = spec["gateway"].get("tenantsSecretRef")
    if tenants:
        files += secret_files.mounted_secret("tenants", tenants["name"], {TENANTS_KEY: TENANTS_KEY}, TENANTS_DIR)
    batch_volumes, batch_mounts = batch.volumes(spec)
    volumes += files.volumes + batch_volumes
    mounts += files.mounts + batch_mounts
    return volumes, mounts


def _strategy(spec: dict) -> dict:
    """Roll one extra pod in, never one fewer; but a gateway whose Batch API store is a directory
    (spec.batch.volume) is replaced: two would share the store, and a ReadWriteOnce claim cannot
    attach to a second node, which would hold a rolling update up for ever."""
    if batch.single_writer(spec):
        return {"type": "Recreate"}
    return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}


def deployment(owner: Owner, spec: dict) -> dict:
    gw = spec["gateway"]
    volumes, mounts = _volumes(spec, owner)
    container = {
        "name": "gateway",
        "image": image(spec),
        "imagePullPolicy": spec["imagePullPolicy"],
        "command": ["tessera"],
        "args": ["gateway", "--config", f"{CONFIG_DIR}/{CONFIG_FILE}"],
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
                  {"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
                  {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"}],
        "resources": pod_parts.resources(gw["resources"]),
        # Ready while it takes requests (queued ones too, at zero pods);
        # live while it answers: pods being gone is no reason to restart it.
        "readinessProbe": _probe("/health/ready", 5, 2),
        "livenessProbe": _probe("/health/live", 10, 6),
        "lifecycle": pod_parts.prestop_sleep(),
        "env": (secret_files.internal_secret_env() + pod_parts.SCRATCH_ENV
                + pod_parts.tracing_env(spec, GATEWAY_SERVICE_NAME) + batch.env(spec)),
        "securityContext": pod_parts.container_security_context(),
        "volumeMounts": mounts,
    }
    labels = names.labels(owner, "gateway")
    # A changed config must restart the gateway: the hash in the pod template makes that a rollout.
    digest = hashlib.sha256(config_text(owner, spec).encode()).hexdigest()[:16]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": pod_parts.object_meta(owner, names.gateway_name(owner), labels),
        "spec": {
            "replicas": gw["replicas"],
            "selector": {"matchLabels": names.selector(owner, "gateway")},
            "strategy": _strategy(spec),
            "template": {
                "metadata": {"labels": labels, "annotations": {names.CONFIG_HASH_ANNOTATION: digest,
                                                               **pod_parts.scrape_annotations(METRICS_PORT)}},
                "spec": {
                    "securityContext": pod_parts.pod_security_context(),
                    "serviceAccountName": names.gateway_name(owner),
                    "containers": [container],
                    # Streams in flight last as long as the engines' drain allows.
                    "terminationGracePeriodSeconds": pod_parts.termination_grace(
                        spec["engine"]["drainTimeoutSeconds"]),
                    "enableServiceLinks": False,
                    "volumes": volumes,
                },
            },
        },
    }


def service(owner: Owner, spec: dict) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": pod_parts.object_meta(owner, names.gateway_name(owner), names.labels(owner, "gateway")),
        "spec": {
            "type": spec["gateway"]["serviceType"],
            "selector": names.selector(owner, "gateway"),
            # No metrics port: a LoadBalancer would publish it. Prometheus and the operator scrape the pods.
            "ports": [{"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
                      {"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc", "protocol": "TCP"}],
        },
    }


def rbac(owner: Owner) -> list[dict]:
    """ServiceAccount and a Role that can only read EndpointSlices of this namespace (pod discovery)."""
    name = names.gateway_name(owner)
    labels = names.labels(owner, "gateway")
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": pod_parts.object_meta(owner, name, labels)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
         "metadata": pod_parts.object_meta(owner, name, labels),
         "rules": [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                    "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": pod_parts.object_meta(owner, name, labels),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}]},
    ]
