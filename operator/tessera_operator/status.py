"""The InferenceService's status from its workloads (Deployments, and LeaderWorkerSets for
pipeline-parallel pools, whose readyReplicas count ready groups): replicas per pool, the LoRA
adapters served, and conditions.

A component's condition is True when it can serve: at least one ready pod,
or a pool deliberately scaled to zero (the gateway queues its requests and
the autoscaler lifts it). `Ready` is True when every component is.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera_operator import engine_pool, loras, names
from tessera_operator.names import Owner

POOL_CONDITION = {"mixed": "EngineReady", "prefill": "PrefillReady", "decode": "DecodeReady"}


@dataclass(frozen=True)
class Condition:
    type: str
    ok: bool
    reason: str
    message: str

    def as_dict(self, generation: int, now: str, previous: dict | None) -> dict:
        status = "True" if self.ok else "False"
        # The transition time moves only when the status does.
        since = previous["lastTransitionTime"] if previous and previous.get("status") == status else now
        return {"type": self.type, "status": status, "reason": self.reason, "message": self.message,
                "lastTransitionTime": since, "observedGeneration": generation}


def _ready_count(workload: dict | None) -> int:
    return int(((workload or {}).get("status") or {}).get("readyReplicas") or 0)


def component_condition(cond_type: str, workload: dict | None, desired: int, kind: str = "Deployment") -> Condition:
    """From a Deployment's ready pods, or a LeaderWorkerSet's ready groups (`kind`)."""
    if workload is None:
        return Condition(cond_type, False, "NotCreated", f"{kind} not found")
    ready = _ready_count(workload)
    unit = "pods" if kind == "Deployment" else "groups"
    if desired == 0:
        return Condition(cond_type, True, "ScaledToZero", "0 replicas; requests wait at the gateway")
    if ready == 0:
        return Condition(cond_type, False, "NoReadyPods", f"0/{desired} {unit} ready")
    return Condition(cond_type, True, "Available", f"{ready}/{desired} {unit} ready")


def overall_condition(parts: list[Condition]) -> Condition:
    waiting = [c.type for c in parts if not c.ok]
    if waiting:
        return Condition("Ready", False, "ComponentsNotReady", "not ready: " + ", ".join(waiting))
    return Condition("Ready", True, "AllComponentsReady", "gateway and engine pools can serve")


def build_status(isvc: dict, deployments: dict[str, dict | None], desired: dict[str, int],
                 old_status: dict, now: str) -> dict:
    """The status to write; `deployments`: the workloads by name (None when missing), `desired`
    replicas by pool."""
    owner, spec = Owner.of(isvc), isvc["spec"]
    generation = isvc["metadata"].get("generation", 0)
    roles = names.active_pools(spec["mode"])
    gw_name = names.gateway_name(owner)
    parts = [component_condition("GatewayReady", deployments.get(gw_name), spec["gateway"]["replicas"])]
    parts += [component_condition(POOL_CONDITION[r], deployments.get(names.pool_name(owner, r)), desired[r],
                                  engine_pool.workload_kind(spec, r)[1]) for r in roles]
    parts.append(overall_condition(parts))
    previous = {c.get("type"): c for c in old_status.get("conditions") or []}
    old_pools = old_status.get("pools") or {}
    pools: dict[str, dict | None] = {r: None for r in POOL_CONDITION}  # null deletes a pool of the other mode
    for r in roles:
        pools[r] = {"desiredReplicas": desired[r],
                    "readyReplicas": _ready_count(deployments.get(names.pool_name(owner, r)))}
        if (old_pools.get(r) or {}).get("lastScaleTime"):
            pools[r]["lastScaleTime"] = old_pools[r]["lastScaleTime"]
    return {
        "observedGeneration": generation,
        "mode": spec["mode"],
        "url": names.gateway_url(owner),
        "pools": pools,
        # null when none: the status is merge-patched, and null deletes a list an earlier spec left.
        "loras": loras.served_names(spec) or None,
        "conditions": [c.as_dict(generation, now, previous.get(c.type)) for c in parts],
    }
