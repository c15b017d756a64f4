"""The emulated cluster and the real operator process for the end-to-end operator tests.

`cluster`: a Kubernetes API emulator (emulator.py) on a free loopback port, with the operator's
kubeconfig written next to it. `start_operator`: `tessera --log-level INFO operator --namespace
NS ...`, the command line the chart runs, as a subprocess of its own pointed at the emulator by
KUBECONFIG; every process still running at the end of a test is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kmock
import pytest
import yaml

from tessera.child_process import PARENT_PID_ENV, free_port
from tessera_operator import crd

from ..conftest import EXAMPLES
from .emulator import Emulator

NAMESPACE = "default"  # the examples' namespace
OPERATOR_NAMESPACE = "tessera-system"
TICK_S = 1.0  # --interval: the timer (autoscaler, drift correction, status refresh)
TIMEOUT_S = 20.0
TESSERA = Path(sys.executable).with_name("tessera")
ISVC_PATH = f"/apis/{crd.GROUP}/{crd.VERSION}/namespaces/{{ns}}/{crd.PLURAL}"
# Every kind the operator creates, by resource (group/version/plural).
KINDS = {
    "Deployment": "apps/v1/deployments",
    "Service": "v1/services",
    "ConfigMap": "v1/configmaps",
    "Secret": "v1/secrets",
    "ServiceAccount": "v1/serviceaccounts",
    "Role": "rbac.authorization.k8s.io/v1/roles",
    "RoleBinding": "rbac.authorization.k8s.io/v1/rolebindings",
    "NetworkPolicy": "networking.k8s.io/v1/networkpolicies",
    "LeaderWorkerSet": "leaderworkerset.x-k8s.io/v1/leaderworkersets",
}


def collection(kind: str, ns: str = NAMESPACE) -> str:
    """The URL path of a kind's objects in a namespace, e.g. /apis/apps/v1/namespaces/NS/deployments."""
    group_version, plural = KINDS[kind].rsplit("/", 1)
    return f"{'/api' if group_version == 'v1' else '/apis'}/{group_version}/namespaces/{ns}/{plural}"


def wait_for(condition: Callable[[], Any], what: str, timeout: float = TIMEOUT_S,
             logs: Callable[[], str] | None = None) -> Any:
    """Poll until `condition()` is truthy and return it; fail naming `what` (and the operator's log)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            tail = ("\n--- operator log (tail) ---\n" + logs()[-6000:]) if logs else ""
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}{tail}")
        time.sleep(0.1)


class Cluster(Emulator):
    """The emulator plus what the tests ask of a cluster, kubectl-style."""

    kubeconfig: Path

    def isvc_path(self, name: str = "", ns: str = NAMESPACE) -> str:
        return ISVC_PATH.format(ns=ns) + (f"/{name}" if name else "")

    def apply_isvc(self, body: dict) -> dict:
        return self.create(self.isvc_path(ns=body["metadata"].get("namespace", NAMESPACE)), body)

    def isvc(self, name: str, ns: str = NAMESPACE) -> dict | None:
        return self.get(self.isvc_path(name, ns))

    def edit_isvc(self, name: str, patch: dict, ns: str = NAMESPACE) -> dict:
        return self.patch(self.isvc_path(name, ns), patch)

    def condition(self, name: str, cond_type: str = "Ready", ns: str = NAMESPACE) -> dict | None:
        conditions = ((self.isvc(name, ns) or {}).get("status") or {}).get("conditions") or []
        return next((c for c in conditions if c["type"] == cond_type), None)

    def owned(self, instance: str, ns: str = NAMESPACE) -> dict[tuple[str, str], dict]:
        """Every object of the kinds the operator makes that carries `instance`'s label: {(kind, name): obj}."""
        found = {}
        for kind in KINDS:
            for obj in self.list(collection(kind, ns), f"tessera.dev/inference-service={instance}"):
                found[(kind, obj["metadata"]["name"])] = obj
        return found

    def deployment(self, name: str, ns: str = NAMESPACE) -> dict | None:
        return self.get(f"{collection('Deployment', ns)}/{name}")

    def history(self, kind: str, name: str, ns: str = NAMESPACE) -> list[dict]:
        """Every version the emulator stored of an object, oldest first (a deletion ends a run)."""
        key = (kmock.resource(KINDS[kind]), ns, name)
        return [dict(v.raw) for v in list(self.api.objects[key].history) if v is not None] \
            if key in self.api.objects else []

    def set_ready(self, deployment: str, ready: int, ns: str = NAMESPACE) -> None:
        """What the Deployment controller would write: `ready` of the wanted pods available."""
        wanted = self.deployment(deployment, ns)["spec"]["replicas"]
        available = "True" if ready >= 1 else "False"
        self.patch(f"{collection('Deployment', ns)}/{deployment}/status", {"status": {
            "replicas": wanted, "updatedReplicas": wanted, "readyReplicas": ready, "availableReplicas": ready,
            "conditions": [{"type": "Available", "status": available, "reason": "MinimumReplicasAvailable"}]}})

    def events(self, instance: str, ns: str = NAMESPACE) -> list[dict]:
        return [e for e in self.list(f"/api/v1/namespaces/{ns}/events")
                if e.get("involvedObject", {}).get("name") == instance]

    def reasons(self, instance: str, ns: str = NAMESPACE) -> list[str]:
        return [e["reason"] for e in self.events(instance, ns)]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with Cluster() as emulated:
        emulated.kubeconfig = emulated.write_kubeconfig(tmp_path / "kubeconfig")
        yield emulated


class OperatorProcess:
    """One `tessera operator` process against the emulator; its output goes to a log file."""

    def __init__(self, cluster: Cluster, log: Path, namespaces: tuple[str, ...], interval: float) -> None:
        self.cluster, self.log_path = cluster, log
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("KUBERNETES_") and "proxy" not in k.lower()}
        # It dies with this process (tessera's die_with_parent), so a killed test run leaves none behind.
        env.update(KUBECONFIG=str(cluster.kubeconfig), PYTHONUNBUFFERED="1", **{PARENT_PID_ENV: str(os.getpid())})
        self.liveness_port = free_port()
        args = [str(TESSERA), "--log-level", "INFO", "operator", "--liveness-port", str(self.liveness_port),
                "--interval", str(interval), "--operator-namespace", OPERATOR_NAMESPACE]
        for ns in namespaces:
            args += ["--namespace", ns]
        watches_before = self._watches()
        with log.open("ab") as out:
            self.process = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT)
        # Up once it watches InferenceServices (after login, discovery and its startup handler).
        wait_for(lambda: self._watches() > watches_before or self.process.poll() is not None,
                 "the operator to watch InferenceServices", logs=self.log)
        assert self.process.poll() is None, f"the operator exited ({self.process.returncode}):\n{self.log()}"
        wait_for(self.healthy, "the liveness endpoint the chart probes", logs=self.log)

    def healthy(self) -> bool:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(f"http://127.0.0.1:{self.liveness_port}/healthz", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def _watches(self) -> int:
        return sum(1 for r in self.cluster.requests()
                   if r.action == "WATCH" and r.resource is not None and r.resource.plural == crd.PLURAL)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        """SIGKILL: no cleanup, no finalizers released, whatever was in flight is cut."""
        if self.alive:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.alive:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def start_operator(cluster: Cluster, tmp_path: Path) -> Iterator[Callable[..., OperatorProcess]]:
    started: list[OperatorProcess] = []

    def start(namespaces: tuple[str, ...] = (NAMESPACE,), interval: float = TICK_S) -> OperatorProcess:
        process = OperatorProcess(cluster, tmp_path / "operator.log", namespaces, interval)
        started.append(process)
        return process

    yield start
    for process in started:
        process.kill()


@pytest.fixture
def operator(start_operator: Callable[..., OperatorProcess]) -> OperatorProcess:
    return start_operator()


def example(name: str) -> dict:
    """examples/inferenceservice-NAME.yaml as a user applies it."""
    (path,) = [p for p in EXAMPLES if p.stem == f"inferenceservice-{name}"]
    return yaml.safe_load(path.read_text())
