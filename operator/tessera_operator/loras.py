"""LoRA adapters (spec.loras, spec.engine.lora) in the rendered objects: the engine pods' volumes
and flags, the gateway's model list and the status's.

An adapter folder on model.pvc's claim is read through the model's own volume at /models; every
other claim or node folder (of spec.loras and engine.lora.runtimeRoots together) is one read-only
volume, mounted once under /loras however many folders it holds. Both pools get the same flags
and volumes: in disaggregated mode the prefill pod computes a prompt's KV with the adapter and
the decode pod goes on with it, so both must hold it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera_operator import pod_parts
from tessera_operator.crd_lora import DEFAULT_MAX_LORA_RANK, DEFAULT_MAX_LORAS

LORAS_MOUNT = "/loras"
VOLUME_PREFIX = "lora-"


@dataclass(frozen=True)
class _Volume:
    """One source of adapter folders as an engine container sees it."""

    name: str
    mount: str
    folder: dict  # the first folder seen on this source: its pvc or hostPath is what to mount


def _source(folder: dict) -> tuple[str, str]:
    """What a volume holds: a claim (any path in it), or one node folder."""
    return ("pvc", folder["pvc"]["claimName"]) if "pvc" in folder else ("hostPath", folder["hostPath"]["path"])


def _settings(spec: dict) -> dict:
    return spec["engine"].get("lora") or {}


def _folders(spec: dict) -> list[dict]:
    return [*spec.get("loras", []), *_settings(spec).get("runtimeRoots", [])]


def _volumes(spec: dict) -> dict[tuple[str, str], _Volume]:
    """Each source by first appearance; the model's own comes first and is not mounted again.
    Numbered names: a claim name may be a 253-character DNS subdomain, a volume name may not."""
    model = spec["model"]
    placed = {_source(model): _Volume(pod_parts.MODEL_VOLUME, pod_parts.MODELS_MOUNT, model)}
    for folder in _folders(spec):
        if _source(folder) not in placed:
            index = len(placed) - 1
            placed[_source(folder)] = _Volume(f"{VOLUME_PREFIX}{index}", f"{LORAS_MOUNT}/{index}", folder)
    return placed


def _path(placed: dict[tuple[str, str], _Volume], folder: dict) -> str:
    return pod_parts.folder_path(placed[_source(folder)].mount, folder)


def enabled(spec: dict) -> bool:
    """Whether the engine pods serve adapters. The schema allows engine.lora only with adapters or
    run-time roots (crd_lora.LORA_SETTINGS_RULE), so either one turns serving on."""
    return bool(spec.get("loras")) or "lora" in spec["engine"]


def engine_args(spec: dict) -> list[str]:
    """`--enable-lora` and its knobs (always spelled out, so a pod's command line says what it holds),
    the adapters as `--lora-modules NAME=PATH ...`, and one `--lora-root` per run-time folder."""
    if not enabled(spec):
        return []
    settings = _settings(spec)
    args = ["--enable-lora", "--max-loras", str(settings.get("maxLoras", DEFAULT_MAX_LORAS)),
            "--max-lora-rank", str(settings.get("maxLoraRank", DEFAULT_MAX_LORA_RANK))]
    if "maxCpuLoras" in settings:
        args += ["--max-cpu-loras", str(settings["maxCpuLoras"])]
    placed = _volumes(spec)
    if spec.get("loras"):
        args += ["--lora-modules", *(f"{a['name']}={_path(placed, a)}" for a in spec["loras"])]
    for root in dict.fromkeys(_path(placed, r) for r in settings.get("runtimeRoots", [])):
        args += ["--lora-root", root]
    return args


def _extra_volumes(spec: dict) -> list[_Volume]:
    return [v for v in _volumes(spec).values() if v.name != pod_parts.MODEL_VOLUME]


def volumes(spec: dict) -> list[dict]:
    """The engine pods' volumes of adapter folders beyond the model's, read-only."""
    return [pod_parts.folder_volume(v.name, v.folder) for v in _extra_volumes(spec)]


def mounts(spec: dict) -> list[dict]:
    """The engine container's mounts of `volumes`, read-only."""
    return [{"name": v.name, "mountPath": v.mount, "readOnly": True} for v in _extra_volumes(spec)]


def served_names(spec: dict) -> list[str]:
    """The adapters every pod serves from the start, in the spec's order."""
    return [a["name"] for a in spec.get("loras", [])]


def gateway_loras(spec: dict) -> list[dict]:
    """The gateway config's `model.loras`: names only (the folders are the pods' business)."""
    return [{"name": name} for name in served_names(spec)]
