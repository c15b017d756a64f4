"""The pure reconcile function: an InferenceService in, the objects it should own out.

No I/O here; the kopf handlers apply the result with server-side apply, so
applying the same list twice changes nothing on the cluster.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera_operator import engine_pool, gateway, names, network_policy
from tessera_operator.names import Owner
from tessera_operator.validation import validate_inference_service


@dataclass(frozen=True)
class ObjectKey:
    api_version: str
    kind: str
    name: str

    @classmethod
    def of(cls, obj: dict) -> ObjectKey:
        return cls(obj["apiVersion"], obj["kind"], obj["metadata"]["name"])


def validated(body: dict) -> dict:
    """The resource with schema defaults; status is the operator's own and is not checked."""
    return validate_inference_service({k: body[k] for k in ("apiVersion", "kind", "metadata", "spec") if k in body})


def desired_replicas(spec: dict, status: dict, role: str) -> int:
    """Replicas of a pool: the spec's, or the autoscaler's last decision (kept in status) within the bounds."""
    pool = spec["pools"][role]
    if not spec["autoscaling"]["enabled"]:
        return pool["replicas"]
    decided = ((status.get("pools") or {}).get(role) or {}).get("desiredReplicas")
    base = pool["replicas"] if decided is None else decided
    return max(pool["minReplicas"], min(pool["maxReplicas"], base))


def pool_replicas(body: dict) -> dict[str, int]:
    """Replicas of each active pool as the resource (spec and status) stands."""
    spec = validated(body)["spec"]
    return {role: desired_replicas(spec, body.get("status") or {}, role) for role in names.active_pools(spec["mode"])}


def desired_objects(body: dict, replicas: dict[str, int] | None = None,
                    operator_namespace: str | None = None) -> list[dict]:
    """Every object the InferenceService owns, in apply order (RBAC, config and NetworkPolicies
    before the pods that use them). The internal Secret is not among them: it is created once,
    never applied (see internal_secret.py).

    `replicas` overrides the pools' replicas with a fresh autoscaler decision;
    `operator_namespace` is where the operator runs (its pods scrape the metrics ports).
    """
    isvc = validated(body)
    spec, status = isvc["spec"], body.get("status") or {}
    owner = Owner.of(isvc)
    objects = gateway.rbac(owner) + [gateway.config_map(owner, spec)]
    objects += network_policy.policies(owner, spec, operator_namespace)
    for role in names.active_pools(spec["mode"]):
        count = (replicas or {}).get(role, desired_replicas(spec, status, role))
        objects += [engine_pool.service(owner, spec, role), engine_pool.workload(owner, spec, role, count)]
    objects += [gateway.deployment(owner, spec), gateway.service(owner, spec)]
    return objects


def stale_keys(existing: list[ObjectKey], desired: list[dict]) -> list[ObjectKey]:
    """Objects this operator made earlier that the spec no longer asks for (e.g. after a mode switch)."""
    wanted = {ObjectKey.of(obj) for obj in desired}
    return [key for key in existing if key not in wanted]
