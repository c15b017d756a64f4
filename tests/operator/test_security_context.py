"""Least privilege by default: every container in every rendered manifest (the chart, and the
operator's objects for every example and test body) runs as the image's non-root user with a
read-only root filesystem, no capabilities, no privilege escalation and seccomp RuntimeDefault,
and gets the writable scratch space it needs instead."""

from __future__ import annotations

import re

import pytest

from tessera_operator import pod_parts
from tessera_operator.reconcile import desired_objects

from .conftest import REPO, load_example
from .test_manifests import VALUES, bodies, render

WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "Job", "Pod"}


def pod_specs() -> dict[str, dict]:
    """label -> pod spec, for every workload the chart and the operator render."""
    out = {}
    for values in VALUES:
        for doc in render(VALUES[values]):
            if doc["kind"] in WORKLOAD_KINDS:
                out[f"chart[{values}]/{doc['metadata']['name']}"] = doc["spec"]["template"]["spec"]
    cases = bodies() | {p.name: load_example(p) for p in sorted((REPO / "examples").glob("*.yaml"))}
    for case, body in cases.items():
        for obj in desired_objects(body, operator_namespace="tessera-system"):
            if obj["kind"] in WORKLOAD_KINDS:
                out[f"{case}/{obj['metadata']['name']}"] = obj["spec"]["template"]["spec"]
    return out


PODS = pod_specs()


def _containers(pod: dict) -> list[dict]:
    return pod["containers"] + pod.get("initContainers", [])


@pytest.mark.parametrize("label", sorted(PODS))
def test_every_container_is_locked_down(label):
    pod = PODS[label]
    sc = pod["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] == pod_parts.RUN_AS_USER
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    secrets = [v["secret"] for v in pod.get("volumes", []) if "secret" in v]
    if secrets:  # root-owned files: readable by the user only through its group, the fsGroup
        assert sc["fsGroup"] == pod_parts.RUN_AS_USER
        assert all(s["defaultMode"] & 0o040 and not s["defaultMode"] & 0o007 for s in secrets)
    for c in _containers(pod):
        csc = c["securityContext"]
        assert csc["readOnlyRootFilesystem"] is True, c["name"]
        assert csc["allowPrivilegeEscalation"] is False, c["name"]
        assert csc["capabilities"] == {"drop": ["ALL"]}, c["name"]  # and nothing added
        assert not csc.get("privileged") and "runAsUser" not in csc, c["name"]


@pytest.mark.parametrize("label", sorted(PODS))
def test_read_only_root_leaves_tmp_writable(label):
    pod = PODS[label]
    volumes = {v["name"]: v for v in pod["volumes"]}
    for c in _containers(pod):
        tmp = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
        assert tmp and "emptyDir" in volumes[tmp[0]["name"]], c["name"]
        env = {e["name"]: e.get("value") for e in c.get("env", [])}
        for name in ("HOME", "TRITON_CACHE_DIR"):
            if name in env:
                assert env[name].startswith("/tmp"), (c["name"], name)


def test_engines_write_their_caches_under_tmp():
    """torch extensions (the image's TORCH_EXTENSIONS_DIR), triton and $HOME caches all land in the emptyDir."""
    engine = PODS["minimal/llama-engine"]["containers"][0]
    env = {e["name"]: e.get("value") for e in engine["env"]}
    assert env["HOME"] == "/tmp" and env["TRITON_CACHE_DIR"].startswith("/tmp/")
    dockerfile = (REPO / "Dockerfile").read_text()
    assert re.search(r"^ENV TORCH_EXTENSIONS_DIR=/tmp/", dockerfile, flags=re.M)
    assert re.search(rf"^USER {pod_parts.RUN_AS_USER}$", dockerfile, flags=re.M)

