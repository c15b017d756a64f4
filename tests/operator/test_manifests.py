"""Generated objects and the rendered chart against the Kubernetes OpenAPI schemas (kubernetes-validate).

Versions: 1.30 (the chart's kubeVersion floor) and 1.37 (the newest schemas kubernetes-validate ships).
"""

from __future__ import annotations

import helm_python
import kubernetes_validate
import pytest
import yaml

from tessera_operator import crd, crd_spec
from tessera_operator.kube import MANAGED_KINDS
from tessera_operator.reconcile import desired_objects

from .conftest import CHART, EXAMPLES, load_example, make_isvc
from .test_loras import LORA_SPEC
from .test_reconcile import FULL_SPEC

K8S_VERSIONS = ["1.30.0", "1.37.0"]


def render(values: dict | None = None, namespace: str = "tessera-system") -> list[dict]:
    rendered = helm_python.Chart.load(CHART).render(values=values or {}, name="tessera", namespace=namespace)
    docs = []
    for path, text in rendered.items():
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def bodies() -> dict[str, dict]:
    cases = {p.name: load_example(p) for p in EXAMPLES}
    cases["minimal"] = make_isvc()
    cases["full"] = make_isvc(FULL_SPEC)
    cases["loras"] = make_isvc({**LORA_SPEC, "mode": "disaggregated"})
    return cases


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("case", sorted(bodies()))
def test_generated_objects_validate(case, version):
    objects = desired_objects(bodies()[case])
    assert {(o["apiVersion"], o["kind"]) for o in objects} <= set(MANAGED_KINDS)
    for obj in objects:
        kubernetes_validate.validate(obj, version, strict=True)


def test_validator_catches_a_broken_object():
    """The check has teeth: a misspelled field fails it."""
    deployment = next(o for o in desired_objects(make_isvc()) if o["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, "1.37.0", strict=True)


VALUES = {
    "default": {},
    "clusterWide": {"clusterWide": True},
    "namespaced": {"watchNamespaces": ["ml", "research"], "image": {"tag": "dev"},
                   "operator": {"nodeSelector": {"pool": "system"},
                                "tolerations": [{"key": "infra", "operator": "Exists"}]}},
}


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("values", sorted(VALUES))
def test_rendered_chart_validates(values, version):
    docs = render(VALUES[values])
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)
    for text in (c["data"] for c in helm_python.Chart.load(CHART).crds):
        kubernetes_validate.validate(yaml.safe_load(text), version, strict=True)


def test_chart_lints_clean():
    report = helm_python.lint(CHART, strict=True, kube_version="v1.30.0")
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_chart_ships_the_crd():
    crds = helm_python.Chart.load(CHART).crds
    assert [yaml.safe_load(c["data"]) for c in crds] == [crd.crd_manifest()]


def _args(docs):
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    return deployment["spec"]["template"]["spec"]["containers"][0]["args"]


def test_default_is_namespaced_to_the_release_with_nothing_cluster_wide():
    docs = render()
    kinds = {d["kind"] for d in docs}
    assert not {"ClusterRole", "ClusterRoleBinding"} & kinds
    assert [(d["kind"], d["metadata"]["namespace"]) for d in docs if d["kind"] in ("Role", "RoleBinding")] == [
        ("Role", "tessera-system"), ("RoleBinding", "tessera-system")]
    args = _args(docs)
    assert "--all-namespaces" not in args
    assert args[args.index("operator"):][:3] == ["operator", "--namespace", "tessera-system"]


def test_cluster_wide_only_when_asked_for():
    docs = render({"clusterWide": True})
    kinds = {d["kind"] for d in docs}
    assert {"ClusterRole", "ClusterRoleBinding", "ServiceAccount", "Deployment"} <= kinds
    assert "Role" not in kinds
    assert "--all-namespaces" in _args(docs) and "--namespace" not in _args(docs)
    with pytest.raises(Exception, match="clusterWide or watchNamespaces"):
        render({"clusterWide": True, "watchNamespaces": ["ml"]})


def test_watched_namespaces_get_roles_and_nothing_cluster_wide():
    docs = render(VALUES["namespaced"])
    assert not {"ClusterRole", "ClusterRoleBinding"} & {d["kind"] for d in docs}
    assert sorted(d["metadata"]["namespace"] for d in docs if d["kind"] == "Role") == ["ml", "research"]
    args = _args(docs)
    assert args[args.index("operator"):] [:5] == ["operator", "--namespace", "ml", "--namespace", "research"]
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == "ghcr.io/tessera-ai/tessera-control-plane:dev"


def test_operator_runs_the_slim_image_its_gateways_get():
    """The chart's default operator image is the control-plane image the operator gives gateway pods."""
    deployment = next(d for d in render() if d["kind"] == "Deployment")
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"] == crd_spec.DEFAULT_CONTROL_PLANE_IMAGE
    version = crd_spec.DEFAULT_CONTROL_PLANE_IMAGE.rsplit(":", 1)[1]
    assert crd_spec.DEFAULT_IMAGE == f"ghcr.io/tessera-ai/tessera:{version}"


def test_operator_deployment_runs_the_cli_with_liveness():
    import argparse

    from tessera_operator.cli import add_parser

    docs = render({"operator": {"livenessPort": 9000, "interval": 30}})
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    spec = deployment["spec"]
    c = spec["template"]["spec"]["containers"][0]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert c["ports"][0]["containerPort"] == 9000
    # The args parse with the real CLI.
    parser = argparse.ArgumentParser()
    parser.add_argument("--log-level")
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(c["args"])
    assert args.namespaces == ["tessera-system"] and args.liveness_port == 9000 and args.interval == 30
    # The operator learns its own namespace (NetworkPolicies admit it to the metrics ports).
    assert c["env"] == [{"name": "TESSERA_OPERATOR_NAMESPACE",
                         "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}]
