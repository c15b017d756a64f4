"""A fake of just the Kubernetes API calls the handlers make (tessera_operator.kube.ClusterApi).

No API server was available where these tests were written: this fake
keeps applied objects in a dict with server-side-apply-like semantics for
fields the operator owns (the applied object replaces them), serves pods
and /metrics text that a test sets up, and records every call, both as the
call (`calls`) and as the API server's authorizer would see it (`verbs`:
(API group, resource, verb), which tests/operator/test_rbac.py compares with
the chart's rules).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from tessera_operator.kube import CREATED_KINDS, MANAGED_KINDS, PRUNED_KINDS
from tessera_operator.reconcile import ObjectKey


def pod(name: str, ip: str, ready: bool = True, phase: str = "Running", terminating: bool = False) -> dict:
    meta = {"name": name}
    if terminating:
        meta["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"phase": phase, "podIP": ip,
                                         "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def labels_match(selector: str, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in (part.split("=", 1) for part in selector.split(",")))


def rbac_resource(api_version: str, kind: str) -> tuple[str, str]:
    """(API group, resource) of a kind, as RBAC rules name them."""
    return api_version.rpartition("/")[0], {**MANAGED_KINDS, **CREATED_KINDS}[(api_version, kind)]


@dataclass
class FakeCluster:
    objects: dict[tuple[str, ObjectKey], dict] = field(default_factory=dict)
    ready: dict[str, int] = field(default_factory=dict)            # Deployment/LeaderWorkerSet name -> readyReplicas
    pods: dict[str, list[dict]] = field(default_factory=dict)      # label selector -> pods
    metrics: dict[str, str] = field(default_factory=dict)          # "ip:port" -> /metrics text
    calls: list[tuple] = field(default_factory=list)
    verbs: set[tuple[str, str, str]] = field(default_factory=set)  # (API group, resource, verb) used
    fail_apply: Exception | None = None

    def _verb(self, api_version: str, kind: str, verb: str) -> None:
        self.verbs.add((*rbac_resource(api_version, kind), verb))

    def apply(self, obj: dict) -> None:
        self.calls.append(("apply", obj["kind"], obj["metadata"]["name"]))
        key = (obj["metadata"]["namespace"], ObjectKey.of(obj))
        # Server-side apply is a PATCH, authorized also as create when the object is new.
        self._verb(obj["apiVersion"], obj["kind"], "patch")
        if key not in self.objects:
            self._verb(obj["apiVersion"], obj["kind"], "create")
        if self.fail_apply:
            raise self.fail_apply
        self.objects[key] = copy.deepcopy(obj)

    def list_managed(self, namespace: str, label_selector: str) -> list[ObjectKey]:
        self.calls.append(("list_managed", namespace, label_selector))
        for api_version, kind in PRUNED_KINDS:
            self._verb(api_version, kind, "list")
        return [key for (ns, key), obj in self.objects.items()
                if ns == namespace and (key.api_version, key.kind) in PRUNED_KINDS
                and labels_match(label_selector, obj["metadata"].get("labels", {}))]

    def delete(self, namespace: str, key: ObjectKey) -> None:
        self.calls.append(("delete", key.kind, key.name))
        self._verb(key.api_version, key.kind, "delete")
        self.objects.pop((namespace, key), None)

    def get_workload(self, namespace: str, api_version: str, kind: str, name: str) -> dict | None:
        self.calls.append(("get_workload", kind, name))
        self._verb(api_version, kind, "get")
        obj = self.objects.get((namespace, ObjectKey(api_version, kind, name)))
        if obj is None:
            return None
        return {**copy.deepcopy(obj), "status": {"readyReplicas": self.ready.get(name, 0)}}

    def secret_exists(self, namespace: str, name: str) -> bool:
        self.calls.append(("secret_exists", name))
        self._verb("v1", "Secret", "get")
        return (namespace, ObjectKey("v1", "Secret", name)) in self.objects

    def create(self, obj: dict) -> bool:
        self.calls.append(("create", obj["kind"], obj["metadata"]["name"]))
        self._verb(obj["apiVersion"], obj["kind"], "create")
        key = (obj["metadata"]["namespace"], ObjectKey.of(obj))
        if key in self.objects:
            return False  # 409 Conflict
        self.objects[key] = copy.deepcopy(obj)
        return True

    def list_pods(self, namespace: str, label_selector: str) -> list[dict]:
        self.calls.append(("list_pods", label_selector))
        self.verbs.add(("", "pods", "list"))
        return copy.deepcopy(self.pods.get(label_selector, []))

    def scrape(self, ip: str, port: int) -> str:
        self.calls.append(("scrape", ip, port))
        try:
            return self.metrics[f"{ip}:{port}"]
        except KeyError:
            raise ConnectionRefusedError(f"{ip}:{port}") from None

    def deployment(self, namespace: str, name: str) -> dict:
        return self.objects[(namespace, ObjectKey("apps/v1", "Deployment", name))]

    def leader_worker_set(self, namespace: str, name: str) -> dict:
        return self.objects[(namespace, ObjectKey("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", name))]

    def secret(self, namespace: str, name: str) -> dict | None:
        return self.objects.get((namespace, ObjectKey("v1", "Secret", name)))

    def writes(self) -> list[tuple]:
        return [c for c in self.calls if c[0] in ("apply", "delete", "create")]
