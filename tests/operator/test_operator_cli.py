"""`tessera operator`: namespace scope, liveness endpoint, and the kopf.run call."""

from __future__ import annotations

import kopf
import pytest

from tessera_tools import cli
from tessera_operator import main as operator_main
from tessera_operator.kube import KubeApi


@pytest.fixture
def kopf_run(monkeypatch):
    calls = []
    monkeypatch.setattr(operator_main.kopf, "run", lambda **kw: calls.append(kw))
    monkeypatch.setattr(operator_main, "load_client_config", lambda: None)
    return calls


def test_one_namespace(kopf_run):
    assert cli.main(["operator", "-n", "ml", "--namespace", "research", "--liveness-port", "9000"]) == 0
    (kw,) = kopf_run
    assert kw["namespaces"] == ["ml", "research"] and kw["clusterwide"] is False
    assert kw["liveness_endpoint"] == "http://0.0.0.0:9000/healthz"
    assert kw["standalone"] is True
    assert isinstance(kw["memo"], kopf.Memo) and isinstance(kw["memo"].api, KubeApi)
    timers = kw["registry"]._spawning.get_all_handlers()
    assert [t.interval for t in timers] == [15.0]


def test_operator_namespace_comes_from_the_environment_the_chart_sets(kopf_run, monkeypatch, caplog):
    """The handlers learn it through the memo: NetworkPolicies admit that namespace to the metrics ports."""
    monkeypatch.setenv("TESSERA_OPERATOR_NAMESPACE", "tessera-system")
    assert cli.main(["operator", "-n", "ml"]) == 0
    assert kopf_run[-1]["memo"].operator_namespace == "tessera-system"
    assert cli.main(["operator", "-n", "ml", "--operator-namespace", "ops"]) == 0
    assert kopf_run[-1]["memo"].operator_namespace == "ops"
    monkeypatch.delenv("TESSERA_OPERATOR_NAMESPACE")
    assert cli.main(["operator", "-n", "ml"]) == 0
    assert kopf_run[-1]["memo"].operator_namespace is None
    assert "no --operator-namespace" in caplog.text


def test_all_namespaces_and_no_liveness(kopf_run):
    assert cli.main(["operator", "--all-namespaces", "--liveness-port", "0", "--interval", "5"]) == 0
    (kw,) = kopf_run
    assert kw["clusterwide"] is True and kw["namespaces"] == []
    assert kw["liveness_endpoint"] is None
    assert kw["registry"]._spawning.get_all_handlers()[0].interval == 5.0


def test_scope_is_required(kopf_run, capsys):
    with pytest.raises(SystemExit):
        cli.main(["operator"])
    assert "-n/--namespace -A/--all-namespaces" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["operator", "-n", "ml", "-A"])
    assert kopf_run == []


def test_bad_interval_is_a_clear_error(kopf_run, capsys):
    assert cli.main(["operator", "-A", "--interval", "0"]) == 2
    assert "interval must be > 0" in capsys.readouterr().err
    assert kopf_run == []


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_real_kopf_serves_liveness_with_our_handlers():
    """kopf.run with the operator's registry answers /healthz even while the API server is unreachable
    (here: a closed port; no cluster was available)."""
    import argparse
    import threading
    import time
    import urllib.request

    port = _free_port()
    options = operator_main.kopf_options(argparse.Namespace(namespaces=["ml"], all_namespaces=False,
                                                            liveness_port=port, interval=5.0))
    registry = options["registry"]
    kopf.on.login(registry=registry)(lambda **_: kopf.ConnectionInfo(server="http://127.0.0.1:9", token="t"))
    options["liveness_endpoint"] = options["liveness_endpoint"].replace("0.0.0.0", "127.0.0.1")
    stop = threading.Event()
    thread = threading.Thread(target=kopf.run, kwargs={**options, "stop_flag": stop,
                                                       "memo": kopf.Memo(api=None)}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as response:
                    assert response.status == 200
                    break
            except OSError:
                assert time.monotonic() < deadline, "liveness endpoint never answered"
                time.sleep(0.2)
    finally:
        stop.set()
        thread.join(15)
    assert not thread.is_alive()


@pytest.mark.parametrize("kubeconfig", ["missing", "empty"])
def test_without_a_cluster_the_operator_says_so_in_one_line(tmp_path, kubeconfig):
    """No in-cluster service account and no usable kubeconfig: one line naming the cause and the
    fix, a non-zero exit, no traceback (the real command, as a user runs it)."""
    import os
    import subprocess
    import sys

    path = tmp_path / "kubeconfig"
    if kubeconfig == "empty":
        path.write_text("apiVersion: v1\nkind: Config\nclusters: []\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")}
    env.update(KUBECONFIG=str(path), HOME=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "tessera_tools.cli", "operator", "-A", "--liveness-port", "0"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("tessera operator: error: no Kubernetes cluster configured")
    assert f"kubeconfig {path}" in lines[0]
    assert lines[0].endswith("set KUBECONFIG to a kubeconfig file, or run in a pod with a service account")
