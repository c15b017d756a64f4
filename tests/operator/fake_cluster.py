"""A fake of just the Kubernetes API calls the handlers make (tessera_operator.kube.ClusterApi).

No API server was available where these tests were written: this fake
keeps applied objects in a dict with server-side-apply-like semantics for
fields the operator owns (the applied object replaces them), serves pods
and /metrics text that a test sets up, and records every call.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from tessera_operator.reconcile import ObjectKey


def pod(name: str, ip: str, ready: bool = True, phase: str = "Running", terminating: bool = False) -> dict:
    meta = {"name": name}
    if terminating:
        meta["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"phase": phase, "podIP": ip,
                                         "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def labels_match(selector: str, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in (part.split("=", 1) for part in selector.split(",")))


@dataclass
class FakeCluster:
    objects: dict[tuple[str, ObjectKey], dict] = field(default_factory=dict)
    ready: dict[str, int] = field(default_factory=dict)            # Deployment name -> readyReplicas
    pods: dict[str, list[dict]] = field(default_factory=dict)      # label selector -> pods
    metrics: dict[str, str] = field(default_factory=dict)          # "ip:port" -> /metrics text
    calls: list[tuple] = field(default_factory=list)
    fail_apply: Exception | None = None

    def apply(self, obj: dict) -> None:
        self.calls.append(("apply", obj["kind"], obj["metadata"]["name"]))
        if self.fail_apply:
            raise self.fail_apply
        self.objects[(obj["metadata"]["namespace"], ObjectKey.of(obj))] = copy.deepcopy(obj)

    def list_managed(self, namespace: str, label_selector: str) -> list[ObjectKey]:
        self.calls.append(("list_managed", namespace, label_selector))
        return [key for (ns, key), obj in self.objects.items()
                if ns == namespace and labels_match(label_selector, obj["metadata"].get("labels", {}))]

    def delete(self, namespace: str, key: ObjectKey) -> None:
        self.calls.append(("delete", key.kind, key.name))
        self.objects.pop((namespace, key), None)

    def get_deployment(self, namespace: str, name: str) -> dict | None:
        self.calls.append(("get_deployment", name))
        obj = self.objects.get((namespace, ObjectKey("apps/v1", "Deployment", name)))
        if obj is None:
            return None
        return {**copy.deepcopy(obj), "status": {"readyReplicas": self.ready.get(name, 0)}}

    def list_pods(self, namespace: str, label_selector: str) -> list[dict]:
        self.calls.append(("list_pods", label_selector))
        return copy.deepcopy(self.pods.get(label_selector, []))

    def scrape(self, ip: str, port: int) -> str:
        self.calls.append(("scrape", ip, port))
        try:
            return self.metrics[f"{ip}:{port}"]
        except KeyError:
            raise ConnectionRefusedError(f"{ip}:{port}") from None

    def deployment(self, namespace: str, name: str) -> dict:
        return self.objects[(namespace, ObjectKey("apps/v1", "Deployment", name))]

    def writes(self) -> list[tuple]:
        return [c for c in self.calls if c[0] in ("apply", "delete")]
