"""The chart's dashboards and Prometheus Operator monitors: rendered with Helm's own
engine (helm_python), the monitors' selectors checked against the objects the
operator really creates."""

from __future__ import annotations

import json

import helm_python
import pytest

from tessera_operator.reconcile import desired_objects

from .conftest import CHART, make_isvc
from .test_manifests import render

DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))
BOTH_POOLS = {"mode": "disaggregated"}


def _kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def _matches(selector: dict, labels: dict) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In", expr
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def _pod_templates() -> dict[str, dict]:
    """Each Deployment the operator makes (gateway, prefill and decode pools): its pod template."""
    return {d["metadata"]["name"]: d["spec"]["template"] for d in desired_objects(make_isvc(BOTH_POOLS))
            if d["kind"] == "Deployment"}


def test_every_dashboard_ships_as_a_configmap_for_the_grafana_sidecar():
    assert [p.name for p in DASHBOARDS] == ["engine-pods.json", "fleet-overview.json", "kv-store.json"]
    maps = _kind(render(), "ConfigMap")
    assert len(maps) == len(DASHBOARDS)
    shipped = {}
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["namespace"] == "tessera-system"
        (key, text), = cm["data"].items()
        shipped[key] = json.loads(text)
    assert shipped == {p.name: json.loads(p.read_text()) for p in DASHBOARDS}


def test_the_sidecar_label_and_namespace_come_from_values():
    values = {"monitoring": {"dashboards": {"label": "dash", "labelValue": "yes", "namespace": "grafana",
                                            "annotations": {"grafana_folder": "Tessera"}}}}
    for cm in _kind(render(values), "ConfigMap"):
        assert cm["metadata"]["labels"]["dash"] == "yes" and "grafana_dashboard" not in cm["metadata"]["labels"]
        assert cm["metadata"]["namespace"] == "grafana"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "Tessera"}
    assert not _kind(render({"monitoring": {"dashboards": {"enabled": False}}}), "ConfigMap")


def test_monitors_are_off_by_default():
    docs = render()
    assert not _kind(docs, "PodMonitor") and not _kind(docs, "ServiceMonitor")


def test_the_pod_monitor_selects_the_gateway_and_engine_pods_on_their_metrics_port():
    values = {"watchNamespaces": ["ml"], "monitoring": {"podMonitor": {"enabled": True},
                                                         "labels": {"release": "kube-prometheus-stack"}}}
    (monitor,) = _kind(render(values), "PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["ml"]}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    templates = _pod_templates()
    assert sorted(templates) == ["llama-decode", "llama-gateway", "llama-prefill"]
    for name, template in templates.items():
        assert _matches(monitor["spec"]["selector"], template["metadata"]["labels"]), name
        ports = [p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])]
        assert endpoint["port"] in ports, (name, ports)
    assert endpoint["path"] == "/metrics"


def test_the_service_monitor_selects_the_engine_pools_services_only():
    values = {"clusterWide": True, "monitoring": {"serviceMonitor": {"enabled": True},
                                                   "podMonitor": {"enabled": True, "components": ["gateway"]}}}
    docs = render(values)
    (monitor,) = _kind(docs, "ServiceMonitor")
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    (endpoint,) = monitor["spec"]["endpoints"]
    services = {s["metadata"]["name"]: s for s in desired_objects(make_isvc(BOTH_POOLS)) if s["kind"] == "Service"}
    selector = monitor["spec"]["selector"]
    selected = sorted(name for name, s in services.items() if _matches(selector, s["metadata"]["labels"]))
    assert selected == ["llama-decode", "llama-prefill"]
    for name in selected:
        assert endpoint["port"] in [p["name"] for p in services[name]["spec"]["ports"]]
    # The gateway's pods are left to the PodMonitor, which no longer takes the engine pods.
    (pods,) = _kind(docs, "PodMonitor")
    templates = _pod_templates()
    assert [n for n, t in templates.items() if _matches(pods["spec"]["selector"], t["metadata"]["labels"])] \
        == ["llama-gateway"]


@pytest.mark.parametrize("monitoring, message", [
    ({"podMonitor": {"enabled": True}, "serviceMonitor": {"enabled": True}},
     "the PodMonitor scrapes the engine pods already"),
    ({"podMonitor": {"enabled": True, "components": ["gateway", "redis"]}},
     '"redis" is neither gateway nor engine'),
])
def test_conflicting_monitor_values_fail_with_a_message(monitoring, message):
    with pytest.raises(helm_python.HelmError) as failed:
        render({"monitoring": monitoring})
    assert message in str(failed.value)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_dashboards_take_their_prometheus_from_a_variable(path):
    board = json.loads(path.read_text())
    assert board["schemaVersion"] >= 39 and board["uid"].startswith("tessera-")
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert panels
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"] and all(t["expr"] and t["datasource"] == panel["datasource"]
                                        for t in panel["targets"]), panel["title"]
        assert panel["description"], panel["title"]
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"]["uid"] == "${datasource}" and v["allValue"] == ".*"


def test_the_fleet_overview_filters_by_tenant_and_priority_class():
    board = json.loads((CHART / "dashboards" / "fleet-overview.json").read_text())
    assert {v["name"] for v in board["templating"]["list"]} == {"datasource", "tenant", "priority_class"}
    gateway_exprs = [t["expr"] for p in board["panels"] if p["type"] != "row" for t in p["targets"]
                     if "tessera_gateway_" in t["expr"] and "tenant" not in t["expr"]]
    # Only the gateway's metrics without those labels (routing by pod, pods by role) are unfiltered.
    assert all("routing_decisions" in e or "pods_routable" in e or "queue_length" in e for e in gateway_exprs), \
        gateway_exprs
