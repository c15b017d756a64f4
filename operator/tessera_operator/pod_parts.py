"""Pieces every pod of an InferenceService shares: the model volume, drain, metadata,
least-privilege security contexts and the writable scratch space they leave."""

from __future__ import annotations

from tessera_operator.names import Owner

MODELS_MOUNT = "/models"
MODEL_VOLUME = "models"
# Seconds a terminating pod keeps serving before SIGTERM: long enough for its
# EndpointSlice entry to turn "terminating" and the gateway to stop picking it.
PRESTOP_SLEEP_SECONDS = 5
# Headroom after the drain, before the kubelet sends SIGKILL.
GRACE_MARGIN_SECONDS = 10
# The image's non-root user (Dockerfile `USER 10001`); the operator chart runs as it too.
RUN_AS_USER = 10001
# The only writable place in a container (the root filesystem is read-only): an emptyDir.
TMP_VOLUME = "tmp"
TMP_MOUNT = "/tmp"
# Where programs that write to $HOME or a cache folder write instead (torch, triton, tokenizers).
SCRATCH_ENV = [{"name": "HOME", "value": TMP_MOUNT}]


def tracing_env(spec: dict, service_name: str) -> list[dict]:
    """spec.tracing as the standard OTEL_* variables of one component's container (none when absent):
    the OTLP endpoint, a parent-based ratio sampler (a trace's first hop decides; the others follow)
    and the component's service.name."""
    tracing = spec.get("tracing")
    if tracing is None:
        return []
    return [
        {"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": tracing["endpoint"]},
        {"name": "OTEL_TRACES_SAMPLER", "value": "parentbased_traceidratio"},
        {"name": "OTEL_TRACES_SAMPLER_ARG", "value": repr(float(tracing["samplingRatio"]))},
        {"name": "OTEL_SERVICE_NAME", "value": service_name},
    ]


def object_meta(owner: Owner, name: str, labels: dict[str, str]) -> dict:
    return {"name": name, "namespace": owner.namespace, "labels": dict(labels),
            "ownerReferences": [owner.reference()]}


def folder_path(mount: str, folder: dict) -> str:
    """Where a folder given as `pvc` or `hostPath` appears inside a container that has its volume at
    `mount`: a claim's volume is its root, so the claim's `path` follows; a node folder is the volume."""
    sub = folder["pvc"].get("path", "") if "pvc" in folder else ""
    return f"{mount}/{sub}".rstrip("/") if sub else mount


def folder_volume(name: str, folder: dict) -> dict:
    """The pod volume of a folder's source, read-only: the whole claim, or the node's folder."""
    if "pvc" in folder:
        return {"name": name, "persistentVolumeClaim": {"claimName": folder["pvc"]["claimName"], "readOnly": True}}
    return {"name": name, "hostPath": {"path": folder["hostPath"]["path"], "type": "Directory"}}


def model_path(model: dict) -> str:
    """Where the checkpoint folder appears inside every container."""
    return folder_path(MODELS_MOUNT, model)


def model_volume(model: dict) -> dict:
    return folder_volume(MODEL_VOLUME, model)


def model_mount() -> dict:
    return {"name": MODEL_VOLUME, "mountPath": MODELS_MOUNT, "readOnly": True}


def prestop_sleep() -> dict:
    return {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_SECONDS)]}}}


def termination_grace(drain_seconds: int) -> int:
    """Pre-stop sleep, then the process's own drain after SIGTERM, then a margin."""
    return PRESTOP_SLEEP_SECONDS + drain_seconds + GRACE_MARGIN_SECONDS


def resources(spec: dict, gpus: int = 0, gpu_resource: str = "") -> dict:
    """Copy requests/limits; GPUs go in limits (and requests, which must equal them for extended resources)."""
    out = {k: dict(spec[k]) for k in ("requests", "limits") if spec.get(k)}
    if gpus > 0:
        out.setdefault("limits", {})[gpu_resource] = gpus
        out.setdefault("requests", {})[gpu_resource] = gpus
    return out


def pod_security_context() -> dict:
    """Non-root with the image's uid; fsGroup makes mounted Secrets readable by it (mode 0440).
    OnRootMismatch: a volume already owned right (a big model PVC) is not chowned file by file
    at every pod start."""
    return {"runAsNonRoot": True, "runAsUser": RUN_AS_USER, "runAsGroup": RUN_AS_USER, "fsGroup": RUN_AS_USER,
            "fsGroupChangePolicy": "OnRootMismatch", "seccompProfile": {"type": "RuntimeDefault"}}


def container_security_context() -> dict:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}


def tmp_volume() -> dict:
    return {"name": TMP_VOLUME, "emptyDir": {}}


def tmp_mount() -> dict:
    return {"name": TMP_VOLUME, "mountPath": TMP_MOUNT}


def scrape_annotations(port: int) -> dict[str, str]:
    """Prometheus's pod-discovery convention: where a pod's /metrics is (its own port, not a public one)."""
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(port), "prometheus.io/path": "/metrics"}
