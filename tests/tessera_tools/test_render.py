"""`tessera render`: the operator's objects for an InferenceService, off-cluster.

The reference is the operator itself: the kopf create handler run against the fake API server
of tests/operator (real kopf objects), whose applied objects the rendered stream must equal.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import kopf
import kubernetes_validate
import pytest
import yaml

from tessera.internal_secret import SECRET_KEY
from tessera_operator.handlers import on_change
from tessera_tools import cli
from tests.operator.fake_cluster import FakeCluster
from tests.operator.test_handlers import call, events  # noqa: F401  (events: a fixture)

ROOT = Path(__file__).resolve().parent.parent.parent
EXAMPLES = [p for p in sorted((ROOT / "examples").glob("*.yaml"))
            if yaml.safe_load(p.read_text()).get("kind") == "InferenceService"]
OPERATOR_NS = "tessera-system"


def render(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(["render", *args])
    out, err = capsys.readouterr()
    return code, out, err


def rendered_objects(text: str) -> list[dict]:
    return [obj for obj in yaml.safe_load_all(text) if obj is not None]


def operator_applies(body: dict, operator_namespace: str | None = None) -> tuple[list[dict], FakeCluster]:
    """What the operator's create handler applies for `body`, in apply order, and the cluster after it."""
    cluster = FakeCluster()
    call(on_change, body, cluster, memo=kopf.Memo(api=cluster, operator_namespace=operator_namespace))
    stored = {(key.kind, key.name): obj for (_, key), obj in cluster.objects.items()}
    return [stored[call[1:]] for call in cluster.calls if call[0] == "apply"], cluster


def with_uid(path: Path, uid: str = "0f6c2a55-uid") -> dict:
    body = yaml.safe_load(path.read_text())
    body["metadata"]["uid"] = uid
    return body


def test_every_inference_service_example_is_covered():
    assert {p.name for p in EXAMPLES} >= {"inferenceservice-mixed.yaml", "inferenceservice-disaggregated.yaml",
                                          "inferenceservice-lora.yaml", "local.yaml", "local-tiny.yaml"}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_render_is_a_stream_of_well_formed_objects(path, capsys):
    code, out, err = render(capsys, "-f", str(path))
    assert code == 0, err
    objects = rendered_objects(out)
    namespace = yaml.safe_load(path.read_text())["metadata"].get("namespace", "default")
    assert objects and len(objects) == out.count("\n---\n") + out.startswith("---\n")
    for obj in objects:
        assert isinstance(obj["apiVersion"], str) and obj["apiVersion"], obj
        assert isinstance(obj["kind"], str) and obj["kind"], obj
        assert obj["metadata"]["name"] and obj["metadata"]["namespace"] == namespace, obj["metadata"]
        # No uid in the file: a reference with an empty uid would be refused by the API server.
        assert "ownerReferences" not in obj["metadata"]
    # The internal secret is generated, never rendered: no Secret, no value of it.
    assert "Secret" not in {obj["kind"] for obj in objects}
    assert f"--from-literal={SECRET_KEY}=" in out.split("\n---\n")[0]


@pytest.mark.parametrize("version", ["1.30.0", "1.37.0"])
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_rendered_objects_apply_cleanly(path, version, capsys):
    """What `kubectl apply` would check: every object against Kubernetes' own schema, strictly
    (an unknown or misplaced field fails, as with kubectl's strict field validation)."""
    code, out, err = render(capsys, "-f", str(path))
    assert code == 0, err
    for obj in rendered_objects(out):
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_render_equals_what_the_operator_applies(path, tmp_path, capsys, events):  # noqa: F811
    body = with_uid(path)
    applied, cluster = operator_applies(body, OPERATOR_NS)
    source = tmp_path / "isvc.yaml"
    source.write_text(yaml.safe_dump(body))
    code, out, err = render(capsys, "-f", str(source), "--operator-namespace", OPERATOR_NS)
    assert code == 0, err
    assert rendered_objects(out) == applied
    # Beyond the applied objects, the operator only created the internal Secret.
    created = [c[1:] for c in cluster.calls if c[0] == "create"]
    assert created == [("Secret", f"{body['metadata']['name']}-internal")]


def test_without_a_uid_only_the_owner_references_differ(tmp_path, capsys, events):  # noqa: F811
    path = ROOT / "examples" / "inferenceservice-mixed.yaml"
    applied, _ = operator_applies(with_uid(path))
    code, out, err = render(capsys, "-f", str(path))
    assert code == 0, err
    for obj in applied:
        assert obj["metadata"].pop("ownerReferences")[0]["uid"] == "0f6c2a55-uid"
    assert rendered_objects(out) == applied


def test_namespace_flag_renders_into_another_namespace(tmp_path, capsys, events):  # noqa: F811
    path = ROOT / "examples" / "inferenceservice-disaggregated.yaml"
    body = with_uid(path)
    body["metadata"]["namespace"] = "team-a"
    applied, _ = operator_applies(body)
    source = tmp_path / "isvc.yaml"
    source.write_text(yaml.safe_dump(with_uid(path)))
    code, out, err = render(capsys, "-f", str(source), "--namespace", "team-a")
    assert code == 0, err
    objects = rendered_objects(out)
    assert {obj["metadata"]["namespace"] for obj in objects} == {"team-a"}
    # The file's uid is the resource's in its own namespace: no reference across namespaces.
    for obj in applied:
        obj["metadata"].pop("ownerReferences")
    assert objects == applied
    assert "gateway.yaml" in objects[3]["data"] and "namespace: team-a" in objects[3]["data"]["gateway.yaml"]


def test_a_missing_namespace_is_default(tmp_path, capsys):
    body = yaml.safe_load((ROOT / "examples" / "local-tiny.yaml").read_text())
    del body["metadata"]["namespace"]
    source = tmp_path / "isvc.yaml"
    source.write_text(yaml.safe_dump(body))
    code, out, _ = render(capsys, "-f", str(source))
    assert code == 0
    assert {obj["metadata"]["namespace"] for obj in rendered_objects(out)} == {"default"}


def test_several_resources_in_one_file_and_output_file(tmp_path, capsys):
    mixed = (ROOT / "examples" / "inferenceservice-mixed.yaml").read_text()
    pd = (ROOT / "examples" / "inferenceservice-disaggregated.yaml").read_text()
    source, target = tmp_path / "both.yaml", tmp_path / "out.yaml"
    source.write_text(mixed + "\n---\n" + pd)
    code, out, _ = render(capsys, "-f", str(source), "-o", str(target))
    assert code == 0 and out == ""
    objects = rendered_objects(target.read_text())
    owners = {obj["metadata"]["labels"]["tessera.dev/inference-service"] for obj in objects}
    assert owners == {"llama-mixed", "llama-pd"}


def test_a_user_internal_secret_is_named_not_generated(tmp_path, capsys):
    body = yaml.safe_load((ROOT / "examples" / "inferenceservice-mixed.yaml").read_text())
    body["spec"]["internalSecretRef"] = {"name": "my-internal"}
    source = tmp_path / "isvc.yaml"
    source.write_text(yaml.safe_dump(body))
    code, out, _ = render(capsys, "-f", str(source))
    assert code == 0
    head = out.split("\n---\n")[0]
    assert "create secret" not in head and "my-internal" in head


@pytest.mark.parametrize("text, message", [
    ("apiVersion: tessera.dev/v1alpha1\nkind: InferenceService\nmetadata: {name: x}\n"
     "spec: {model: {name: m, pvc: {claimName: c}}, engine: {maxNumSeqs: 0}}\n",
     "spec.engine.maxNumSeqs: must be >= 1 (got 0)"),
    ("apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n",
     "kind: must be 'InferenceService' (got 'ConfigMap'): not an InferenceService"),
])
def test_an_invalid_resource_renders_nothing(text, message, tmp_path, capsys):
    source = tmp_path / "bad.yaml"
    # A valid resource first: nothing of it is printed either.
    source.write_text((ROOT / "examples" / "local-tiny.yaml").read_text() + "\n---\n" + text)
    code, out, err = render(capsys, "-f", str(source))
    assert code == 1 and out == ""
    assert f"{source}#2: {message}" in err.splitlines()


def test_unreadable_files_are_clear_errors(tmp_path, capsys):
    code, out, err = render(capsys, "-f", str(tmp_path / "nope.yaml"))
    assert code == 2 and out == ""
    assert err.strip() == f"tessera render: error: {tmp_path / 'nope.yaml'}: no such file"


def test_render_runs_as_a_subprocess_and_round_trips(tmp_path):
    path = ROOT / "examples" / "inferenceservice-lora.yaml"
    proc = subprocess.run([sys.executable, "-m", "tessera_tools.cli", "render", "-f", "-"], input=path.read_text(),
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    # Rendering again gives the same bytes (a GitOps diff shows only real changes).
    again = subprocess.run([sys.executable, "-m", "tessera_tools.cli", "render", "-f", str(path)],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert again.stdout.split("\n---\n", 1)[1] == proc.stdout.split("\n---\n", 1)[1]
    assert rendered_objects(proc.stdout) == rendered_objects(again.stdout)
