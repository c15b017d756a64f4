"""The few Kubernetes API calls the handlers make, behind one small interface.

Objects stay plain dicts end to end (the reconcile function's output), so
the calls go through the client's generic request path instead of typed
models. Writes are server-side apply with one field manager: applying the
same object twice is a no-op, and fields someone changed by hand (replicas
of a managed Deployment, say) are taken back. The one exception is the
internal Secret: created once if absent (`create`), never applied, since
applying a fresh random value would rotate it on every pass.
"""

from __future__ import annotations

import json
import urllib.request
from typing import Protocol

from kubernetes import client

from tessera_operator.reconcile import ObjectKey

FIELD_MANAGER = "tessera-operator"
APPLY_CONTENT_TYPE = "application/apply-patch+yaml"
# Every kind the reconcile function emits, with its resource name.
MANAGED_KINDS: dict[tuple[str, str], str] = {
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Service"): "services",
    ("apps/v1", "Deployment"): "deployments",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    # Pipeline-parallel pools (engine_pool.leader_worker_set); the LWS controller serves the kind.
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkersets",
}
# The kinds whose objects come and go with the spec (pools with the mode, policies with their
# switches): only these are listed and pruned. The gateway's ServiceAccount, Role, RoleBinding
# and ConfigMap live as long as the InferenceService, so the operator needs no right to list or
# delete those.
PRUNED_KINDS: tuple[tuple[str, str], ...] = (
    ("apps/v1", "Deployment"), ("v1", "Service"), ("networking.k8s.io/v1", "NetworkPolicy"),
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"))
# Created, never applied nor pruned (the garbage collector removes it with its owner).
CREATED_KINDS: dict[tuple[str, str], str] = {("v1", "Secret"): "secrets"}
HTTP_CONFLICT = 409
METRICS_TIMEOUT_S = 2.0


class ApiError(RuntimeError):
    def __init__(self, status: int, method: str, path: str, body: str) -> None:
        self.status = status
        super().__init__(f"{method} {path}: HTTP {status}: {body[:300]}")


class ClusterApi(Protocol):
    def apply(self, obj: dict) -> None: ...
    def list_managed(self, namespace: str, label_selector: str) -> list[ObjectKey]: ...
    def delete(self, namespace: str, key: ObjectKey) -> None: ...
    def get_workload(self, namespace: str, api_version: str, kind: str, name: str) -> dict | None: ...
    def secret_exists(self, namespace: str, name: str) -> bool: ...
    def create(self, obj: dict) -> bool: ...
    def list_pods(self, namespace: str, label_selector: str) -> list[dict]: ...
    def scrape(self, ip: str, port: int) -> str: ...


def collection_path(api_version: str, kind: str, namespace: str) -> str:
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    resource = MANAGED_KINDS.get((api_version, kind)) or CREATED_KINDS.get((api_version, kind)) or kind.lower() + "s"
    return f"{prefix}/namespaces/{namespace}/{resource}"


class KubeApi:
    """ClusterApi on the official client's configuration (in-cluster or kubeconfig)."""

    def __init__(self, api_client: client.ApiClient | None = None) -> None:
        self.client = api_client or client.ApiClient()

    def _request(self, method: str, path: str, query: list[tuple[str, str]] | None = None,
                 body: dict | None = None, content_type: str | None = None) -> dict | None:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        method, url, headers, body, _ = self.client.param_serialize(
            method=method, resource_path=path, query_params=query or [], header_params=headers, body=body,
            auth_settings=["BearerToken"])
        response = self.client.call_api(method, url, header_params=headers, body=body, _request_timeout=30)
        data = response.read()
        if response.status == 404:
            return None
        if response.status >= 400:
            raise ApiError(response.status, method, path, data.decode(errors="replace"))
        return json.loads(data) if data else {}

    def apply(self, obj: dict) -> None:
        meta = obj["metadata"]
        path = f"{collection_path(obj['apiVersion'], obj['kind'], meta['namespace'])}/{meta['name']}"
        if self._request("PATCH", path, [("fieldManager", FIELD_MANAGER), ("force", "true")], obj,
                         APPLY_CONTENT_TYPE) is None:
            # A 404 on apply: the API server does not serve the kind (a LeaderWorkerSet without its controller).
            raise ApiError(404, "PATCH", path, f"the cluster does not serve {obj['apiVersion']} {obj['kind']}"
                           + (" (install the LeaderWorkerSet controller)" if obj["kind"] == "LeaderWorkerSet" else ""))

    def list_managed(self, namespace: str, label_selector: str) -> list[ObjectKey]:
        keys = []
        for api_version, kind in PRUNED_KINDS:
            found = self._request("GET", collection_path(api_version, kind, namespace),
                                  [("labelSelector", label_selector)]) or {}
            keys += [ObjectKey(api_version, kind, item["metadata"]["name"]) for item in found.get("items", [])]
        return keys

    def delete(self, namespace: str, key: ObjectKey) -> None:
        path = f"{collection_path(key.api_version, key.kind, namespace)}/{key.name}"
        self._request("DELETE", path, [("propagationPolicy", "Background")])

    def get_workload(self, namespace: str, api_version: str, kind: str, name: str) -> dict | None:
        """A Deployment or LeaderWorkerSet (status.readyReplicas: pods, or groups); None when absent."""
        return self._request("GET", f"{collection_path(api_version, kind, namespace)}/{name}")

    def secret_exists(self, namespace: str, name: str) -> bool:
        # The answer is only whether it exists: the value is read by nobody but the pods.
        return self._request("GET", f"{collection_path('v1', 'Secret', namespace)}/{name}") is not None

    def create(self, obj: dict) -> bool:
        """POST the object; False when it exists already (409), which is not an error here."""
        meta = obj["metadata"]
        try:
            self._request("POST", collection_path(obj["apiVersion"], obj["kind"], meta["namespace"]), body=obj)
        except ApiError as e:
            if e.status == HTTP_CONFLICT:
                return False
            raise
        return True

    def list_pods(self, namespace: str, label_selector: str) -> list[dict]:
        found = self._request("GET", f"/api/v1/namespaces/{namespace}/pods", [("labelSelector", label_selector)])
        return (found or {}).get("items", [])

    def scrape(self, ip: str, port: int) -> str:
        host = f"[{ip}]" if ":" in ip else ip  # IPv6 pod addresses
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=METRICS_TIMEOUT_S) as response:
            return response.read().decode()
