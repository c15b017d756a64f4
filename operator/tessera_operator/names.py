"""Names, labels and selectors of the objects an InferenceService owns."""

from __future__ import annotations

from dataclasses import dataclass

from tessera_operator import crd

MANAGED_BY = "tessera-operator"
INSTANCE_LABEL = "tessera.dev/inference-service"
COMPONENT_LABEL = "tessera.dev/component"
POOL_LABEL = "tessera.dev/pool"
CONFIG_HASH_ANNOTATION = "tessera.dev/config-hash"


@dataclass(frozen=True)
class Owner:
    """The custom resource the objects belong to."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def of(cls, body: dict) -> Owner:
        meta = body["metadata"]
        return cls(name=meta["name"], namespace=meta.get("namespace", "default"), uid=meta.get("uid", ""))

    def reference(self) -> dict:
        # No blockOwnerDeletion: setting it needs update rights on the owner's finalizers,
        # and background garbage collection removes the children either way.
        return {"apiVersion": crd.API_VERSION, "kind": crd.KIND, "name": self.name, "uid": self.uid,
                "controller": True}


def active_pools(mode: str) -> tuple[str, ...]:
    return ("mixed",) if mode == "mixed" else ("prefill", "decode")


def pool_name(owner: Owner, role: str) -> str:
    # "engine" rather than "mixed": it reads better in `kubectl get deploy`.
    return f"{owner.name}-engine" if role == "mixed" else f"{owner.name}-{role}"


def gateway_name(owner: Owner) -> str:
    return f"{owner.name}-gateway"


def internal_secret_name(owner: Owner) -> str:
    """The Secret the operator creates when spec.internalSecretRef is absent."""
    return f"{owner.name}-internal"


def engine_policy_name(owner: Owner) -> str:
    # One policy for every engine pool of the resource: they admit the same peers.
    return f"{owner.name}-engine"


def group_policy_name(owner: Owner, role: str) -> str:
    """The NetworkPolicy between the pods of a pipeline-parallel pool's groups."""
    return f"{pool_name(owner, role)}-group"


def redis_policy_name(owner: Owner) -> str:
    return f"{owner.name}-redis"


def redis_key_prefix(owner: Owner) -> str:
    """Redis keys of this InferenceService's pods start with this, so a Redis ACL can give each
    InferenceService its own key space (`~tessera:NAMESPACE/NAME:*`)."""
    return f"tessera:{owner.namespace}/{owner.name}:"


def selector(owner: Owner, component: str, role: str | None = None) -> dict[str, str]:
    """The immutable Deployment selector: only labels that never change for the object."""
    sel = {INSTANCE_LABEL: owner.name, COMPONENT_LABEL: component}
    if role is not None:
        sel[POOL_LABEL] = role
    return sel


def labels(owner: Owner, component: str, role: str | None = None) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "tessera",
        "app.kubernetes.io/instance": owner.name,
        "app.kubernetes.io/component": component if role is None else f"{component}-{role}",
        "app.kubernetes.io/managed-by": MANAGED_BY,
        **selector(owner, component, role),
    }


def instance_selector(owner: Owner) -> str:
    """Label selector (string form) of everything this operator made for the resource."""
    return f"{INSTANCE_LABEL}={owner.name},app.kubernetes.io/managed-by={MANAGED_BY}"


def selector_string(labels_: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels_.items())


def pool_selector(owner: Owner, role: str) -> str:
    """Every pod of a pool (engine_pool.pod_selector: its serving pods)."""
    return selector_string(selector(owner, "engine", role))


def gateway_selector(owner: Owner) -> str:
    return ",".join(f"{k}={v}" for k, v in selector(owner, "gateway").items())


def gateway_url(owner: Owner) -> str:
    return f"http://{gateway_name(owner)}.{owner.namespace}.svc:8000"
