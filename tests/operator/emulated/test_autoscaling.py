"""The autoscaler of the real operator process, fed by an engine pod's /metrics, and a user editing
the spec under it: the spec is the only input a user writes, the autoscaler's decision lives in
status, and neither undoes the other."""

from __future__ import annotations

import contextlib
import http.server
import threading
import time
from collections.abc import Iterator

import pytest

from tessera_operator.engine_pool import METRICS_PORT

from .conftest import NAMESPACE, TICK_S, example, wait_for


class Metrics:
    """/metrics of one fake engine pod, on a loopback address of its own and the engine's port."""

    def __init__(self) -> None:
        self.text = ""


@contextlib.contextmanager
def metrics_endpoint(metrics: Metrics) -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = metrics.text.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = None
    for last in range(11, 60):  # the port is the engine's (the operator scrapes podIP:9090): vary the address
        ip = f"127.83.0.{last}"
        try:
            server = http.server.ThreadingHTTPServer((ip, METRICS_PORT), Handler)
            break
        except OSError:
            continue
    if server is None:
        pytest.skip(f"no loopback address with port {METRICS_PORT} free for a fake engine pod's /metrics")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield ip
    finally:
        server.shutdown()
        server.server_close()


def ready_engine_pod(cluster, instance: str, ip: str) -> None:
    """What the Deployment's ReplicaSet and the kubelet would make: one running, ready engine pod."""
    path = f"/api/v1/namespaces/{NAMESPACE}/pods"
    labels = {"tessera.dev/inference-service": instance, "tessera.dev/component": "engine", "tessera.dev/pool": "mixed",
              "app.kubernetes.io/managed-by": "tessera-operator"}
    pod = cluster.create(path, {"metadata": {"name": f"{instance}-engine-7f9c-x1", "labels": labels},
                                "spec": {"containers": [{"name": "engine", "image": "tessera"}]}})
    cluster.patch(f"{path}/{pod['metadata']['name']}/status", {"status": {
        "phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]}})


def steady(cluster, name: str, ticks: int = 3) -> dict:
    """The engine Deployment over a few ticks: no write to it (no fight) in that time."""
    before = cluster.deployment(f"{name}-engine")
    time.sleep(ticks * TICK_S)
    after = cluster.deployment(f"{name}-engine")
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"], \
        (before["spec"]["replicas"], after["spec"]["replicas"])
    return after


def test_the_autoscaler_and_a_users_edits_never_fight(cluster, operator):
    body = example("mixed")  # 2 replicas in [1, 6]; concurrency target 16 per pod
    name = body["metadata"]["name"]
    metrics = Metrics()
    metrics.text = "tessera_num_requests_running 40\ntessera_num_requests_waiting 0\n"
    with metrics_endpoint(metrics) as ip:
        ready_engine_pod(cluster, name, ip)
        cluster.apply_isvc(body)

        # 40 requests in flight on the one ready pod, 16 the target: 3 pods (ceil(1 x 40/16)).
        wait_for(lambda: (d := cluster.deployment(f"{name}-engine")) and d["spec"]["replicas"] == 3,
                 "a scale-up to 3", logs=operator.log)
        pool = wait_for(lambda: ((cluster.isvc(name).get("status") or {}).get("pools") or {}).get("mixed", {})
                        .get("lastScaleTime") and cluster.isvc(name)["status"]["pools"]["mixed"], "lastScaleTime")
        assert pool["desiredReplicas"] == 3
        steady(cluster, name)
        scale_ups = [e["message"] for e in cluster.events(name) if e["reason"] == "ScaleUp"]
        assert scale_ups == ["mixed pool 2 -> 3: concurrency 40 vs target 16 (ratio 2.50)"]

        # A user edits an engine flag: the pods change, the autoscaler's 3 replicas stay (the
        # spec's `replicas: 2` is only the starting count), and the operator leaves the spec alone.
        cluster.edit_isvc(name, {"spec": {"engine": {"maxNumBatchedTokens": 8192}}})
        wait_for(lambda: "8192" in cluster.deployment(f"{name}-engine")["spec"]["template"]["spec"]["containers"][0]
                 ["args"], "the edit to reach the pods", logs=operator.log)
        wait_for(lambda: "Updating is processed" in operator.log(), "the change handler's pass")
        assert steady(cluster, name)["spec"]["replicas"] == 3
        assert [e["reason"] for e in cluster.events(name)].count("ScaleUp") == 1  # never down to 2 and back
        assert cluster.isvc(name)["spec"]["pools"]["mixed"]["replicas"] == 2

        # The user caps the pool below the autoscaler's choice: the cap wins at once and holds,
        # while the metrics still ask for 3.
        cluster.edit_isvc(name, {"spec": {"pools": {"mixed": {"maxReplicas": 2}}}})
        wait_for(lambda: cluster.deployment(f"{name}-engine")["spec"]["replicas"] == 2, "the cap of 2",
                 logs=operator.log)
        assert steady(cluster, name)["spec"]["replicas"] == 2
        assert cluster.isvc(name)["status"]["pools"]["mixed"]["desiredReplicas"] == 2

        # The cap lifted, the autoscaler takes over again from where the user left it.
        cluster.edit_isvc(name, {"spec": {"pools": {"mixed": {"maxReplicas": 6}}}})
        wait_for(lambda: cluster.deployment(f"{name}-engine")["spec"]["replicas"] == 3, "the scale-up to 3 again",
                 logs=operator.log)
        assert steady(cluster, name)["spec"]["replicas"] == 3

    # Every replica count the engine Deployment ever had: the spec's (unless the first tick came
    # before the change handler), the autoscaler's, the cap, the autoscaler's again; never a step
    # back and forth between the change handler and the timer.
    counts = [v["spec"]["replicas"] for v in cluster.history("Deployment", f"{name}-engine")]
    assert [n for i, n in enumerate(counts) if i == 0 or n != counts[i - 1]] in ([2, 3, 2, 3], [3, 2, 3])
    assert cluster.reasons(name).count("ScaleUp") == 2
    isvc = cluster.isvc(name)
    assert isvc["metadata"]["generation"] == 4  # the create and the user's three edits, nothing else
    assert isvc["spec"]["pools"]["mixed"] == {**body["spec"]["pools"]["mixed"], "maxReplicas": 6}
    assert operator.alive
