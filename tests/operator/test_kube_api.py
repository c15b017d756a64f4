"""KubeApi's HTTP requests, against a local server that records them (paths, verbs, apply headers)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest
from kubernetes import client

from tessera.internal_secret import InternalSecret
from tessera_operator.internal_secret import secret_object
from tessera_operator.kube import ApiError, KubeApi
from tessera_operator.names import Owner
from tessera_operator.reconcile import ObjectKey, desired_objects

from .conftest import make_isvc


class Recorder(BaseHTTPRequestHandler):
    seen: list[dict] = []

    def _handle(self):
        url = urlsplit(self.path)
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.recorded_body = body
        self.seen.append({"method": self.command, "path": url.path, "query": parse_qs(url.query),
                          "content_type": self.headers.get("Content-Type"), "body": body})
        status, reply = self._reply(url.path)
        data = json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _reply(self, path):
        if path.endswith("/missing"):
            return 404, {"kind": "Status", "code": 404}
        if path.endswith("/forbidden"):
            return 403, {"kind": "Status", "message": "forbidden"}
        if self.command == "POST" and (self.recorded_body or {}).get("metadata", {}).get("name") == "taken":
            return 409, {"kind": "Status", "code": 409, "reason": "AlreadyExists"}
        if self.command == "POST" and (self.recorded_body or {}).get("metadata", {}).get("name") == "refused":
            return 403, {"kind": "Status", "message": "forbidden"}
        if self.command == "GET" and path.endswith(("/pods", "/deployments", "/services")):
            return 200, {"items": [{"metadata": {"name": "x"}}]}
        if self.command == "GET" and path.rsplit("/", 1)[0].endswith(("/deployments", "/leaderworkersets")):
            return 200, {"metadata": {"name": "d"}, "status": {"readyReplicas": 2}}
        return 200, {"items": []} if self.command == "GET" else {}

    do_GET = do_PATCH = do_DELETE = do_POST = _handle

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    Recorder.seen = []
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    config = client.Configuration()
    config.host = f"http://127.0.0.1:{httpd.server_address[1]}"
    yield KubeApi(client.ApiClient(config)), Recorder.seen
    httpd.shutdown()


def test_apply_is_server_side_apply_on_the_right_paths(server):
    api, seen = server
    objects = desired_objects(make_isvc())
    for obj in objects:
        api.apply(obj)
    paths = [r["path"] for r in seen]
    assert paths == [
        "/api/v1/namespaces/ml/serviceaccounts/llama-gateway",
        "/apis/rbac.authorization.k8s.io/v1/namespaces/ml/roles/llama-gateway",
        "/apis/rbac.authorization.k8s.io/v1/namespaces/ml/rolebindings/llama-gateway",
        "/api/v1/namespaces/ml/configmaps/llama-gateway",
        "/apis/networking.k8s.io/v1/namespaces/ml/networkpolicies/llama-engine",
        "/apis/networking.k8s.io/v1/namespaces/ml/networkpolicies/llama-gateway",
        "/api/v1/namespaces/ml/services/llama-engine",
        "/apis/apps/v1/namespaces/ml/deployments/llama-engine",
        "/apis/apps/v1/namespaces/ml/deployments/llama-gateway",
        "/api/v1/namespaces/ml/services/llama-gateway",
    ]
    for request, obj in zip(seen, objects):
        assert request["method"] == "PATCH"
        assert request["content_type"] == "application/apply-patch+yaml"
        assert request["query"] == {"fieldManager": ["tessera-operator"], "force": ["true"]}
        assert request["body"] == obj


def test_reads_lists_and_deletes(server):
    api, seen = server
    assert api.get_workload("ml", "apps/v1", "Deployment", "llama-engine")["status"]["readyReplicas"] == 2
    assert api.get_workload("ml", "apps/v1", "Deployment", "missing") is None
    lws = api.get_workload("ml", "leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet", "llama-engine")
    assert lws["status"]["readyReplicas"] == 2
    assert seen[-1]["path"] == "/apis/leaderworkerset.x-k8s.io/v1/namespaces/ml/leaderworkersets/llama-engine"
    assert api.list_pods("ml", "a=b") == [{"metadata": {"name": "x"}}]
    keys = api.list_managed("ml", "tessera.dev/inference-service=llama")
    assert ObjectKey("apps/v1", "Deployment", "x") in keys and ObjectKey("v1", "Service", "x") in keys
    api.delete("ml", ObjectKey("apps/v1", "Deployment", "llama-engine"))
    delete = seen[-1]
    assert (delete["method"], delete["path"]) == ("DELETE", "/apis/apps/v1/namespaces/ml/deployments/llama-engine")
    assert delete["query"] == {"propagationPolicy": ["Background"]}
    lists = [r for r in seen if r["query"].get("labelSelector") == ["tessera.dev/inference-service=llama"]]
    assert len(lists) == 4  # one per pruned kind: Deployment, Service, NetworkPolicy, LeaderWorkerSet
    assert "/apis/leaderworkerset.x-k8s.io/v1/namespaces/ml/leaderworkersets" in {r["path"] for r in lists}


def test_errors_raise_with_the_status(server):
    api, _ = server
    with pytest.raises(ApiError) as info:
        api.get_workload("ml", "apps/v1", "Deployment", "forbidden")
    assert info.value.status == 403 and "forbidden" in str(info.value)


def test_apply_of_a_kind_the_cluster_does_not_serve_is_an_error(server):
    """A 404 on apply (no LeaderWorkerSet CRD: its controller is not installed) is no silent success."""
    api, _ = server
    lws = next(o for o in desired_objects(make_isvc({"engine": {"pipelineParallelSize": 2}}))
               if o["kind"] == "LeaderWorkerSet")
    with pytest.raises(ApiError, match="install the LeaderWorkerSet controller") as info:
        api.apply({**lws, "metadata": {**lws["metadata"], "name": "missing"}})
    assert info.value.status == 404


def test_secret_is_read_for_existence_and_created_once(server):
    """GET answers whether the internal Secret exists; POST creates it; 409 (made meanwhile) is no error."""
    api, seen = server
    assert api.secret_exists("ml", "missing") is False
    assert api.secret_exists("ml", "llama-internal") is True
    assert [(r["method"], r["path"]) for r in seen] == [("GET", "/api/v1/namespaces/ml/secrets/missing"),
                                                       ("GET", "/api/v1/namespaces/ml/secrets/llama-internal")]
    secret = secret_object(Owner("llama", "ml", "uid-1"), InternalSecret.generate())
    assert api.create(secret) is True
    assert (seen[-1]["method"], seen[-1]["path"], seen[-1]["body"]) == ("POST", "/api/v1/namespaces/ml/secrets",
                                                                        secret)
    assert api.create({**secret, "metadata": {**secret["metadata"], "name": "taken"}}) is False
    with pytest.raises(ApiError) as info:
        api.create({**secret, "metadata": {**secret["metadata"], "name": "refused"}})
    assert info.value.status == 403
