"""Pieces every pod of an InferenceService shares: the model volume, drain, metadata."""

from __future__ import annotations

from tessera_operator.names import Owner

MODELS_MOUNT = "/models"
MODEL_VOLUME = "models"
# Seconds a terminating pod keeps serving before SIGTERM: long enough for its
# EndpointSlice entry to turn "terminating" and the gateway to stop picking it.
PRESTOP_SLEEP_SECONDS = 5
# Headroom after the drain, before the kubelet sends SIGKILL.
GRACE_MARGIN_SECONDS = 10


def object_meta(owner: Owner, name: str, labels: dict[str, str]) -> dict:
    return {"name": name, "namespace": owner.namespace, "labels": dict(labels),
            "ownerReferences": [owner.reference()]}


def model_path(model: dict) -> str:
    """Where the checkpoint folder appears inside every container."""
    sub = model["pvc"].get("path", "") if "pvc" in model else ""
    return f"{MODELS_MOUNT}/{sub}".rstrip("/") if sub else MODELS_MOUNT


def model_volume(model: dict) -> dict:
    if "pvc" in model:
        return {"name": MODEL_VOLUME,
                "persistentVolumeClaim": {"claimName": model["pvc"]["claimName"], "readOnly": True}}
    return {"name": MODEL_VOLUME, "hostPath": {"path": model["hostPath"]["path"], "type": "Directory"}}


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
