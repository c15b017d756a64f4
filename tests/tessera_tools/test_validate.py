"""`tessera validate`: InferenceService files against the CRD's schema (jsonschema) and the CEL rules' twins."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from tessera_operator import crd
from tessera_operator.schema_check import check, json_schema, schema_errors
from tessera_operator.validation import FieldError
from tessera_tools import cli

ROOT = Path(__file__).resolve().parent.parent.parent
EXAMPLES = [p for p in sorted((ROOT / "examples").glob("*.yaml"))
            if yaml.safe_load(p.read_text()).get("kind") == "InferenceService"]
CHART_CRD = ROOT / "charts" / "tessera" / "crds" / "inferenceservices.tessera.dev.yaml"
HEAD = "apiVersion: tessera.dev/v1alpha1\nkind: InferenceService\nmetadata: {name: llama}\n"
MODEL = "  model: {name: m, pvc: {claimName: models}}\n"


def validate(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(["validate", *args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_is_valid(path, capsys):
    assert validate(capsys, "-f", str(path)) == (0, f"{path}: valid\n", "")


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_is_valid_against_the_chart_crd(path, capsys):
    assert validate(capsys, "-f", str(path), "--crd", str(CHART_CRD))[0] == 0


BAD = {
    "unknown field": (HEAD + "spec:\n" + MODEL + "  engine: {maxNumSeq: 8}\n",
                      ["spec.engine.maxNumSeq: unknown field (known: "]),
    "wrong type": (HEAD + "spec:\n" + MODEL + "  engine: {blockSize: '16'}\n",
                   ["spec.engine.blockSize: must be an integer (got str)"]),
    "out of range": (HEAD + "spec:\n" + MODEL + "  engine: {maxNumSeqs: 0}\n",
                     ["spec.engine.maxNumSeqs: must be >= 1 (got 0)"]),
    "not in enum": (HEAD + "spec:\n" + MODEL + "  mode: split\n",
                    ["spec.mode: must be one of ['mixed', 'disaggregated'] (got 'split')"]),
    "missing field": (HEAD + "spec: {mode: mixed}\n", ["spec.model: required"]),
    "bad quantity": (HEAD + "spec:\n" + MODEL + "  pools: {mixed: {resources: {limits: {memory: lots}}}}\n",
                     ["spec.pools.mixed.resources.limits.memory: 'lots' does not match "]),
    "CEL rule": (HEAD + "spec:\n" + MODEL + "  pools: {mixed: {minReplicas: 5, maxReplicas: 2}}\n",
                 ["spec.pools.mixed: minReplicas must not exceed maxReplicas"]),
    "CEL rule on the name": (HEAD.replace("llama", "Llama_8B") + "spec:\n" + MODEL,
                             ["metadata.name must be a DNS label"]),
    "not an InferenceService": ("apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: x}\n",
                                ["kind: must be 'InferenceService' (got 'Deployment'): not an InferenceService"]),
    "not a mapping": ("- a\n- b\n", ["not an InferenceService: a YAML mapping is needed (got a list)"]),
    "metadata not a mapping": (HEAD.replace("{name: llama}", "llama") + "spec:\n" + MODEL,
                               ["metadata: must be an object (got str)"]),
}


@pytest.mark.parametrize("name", BAD)
def test_a_bad_resource_is_named_field_by_field(name, tmp_path, capsys):
    text, expected = BAD[name]
    source = tmp_path / "isvc.yaml"
    source.write_text(text)
    code, out, err = validate(capsys, "-f", str(source))
    assert code == 1 and err == "", out
    lines = out.splitlines()
    for message in expected:
        assert any(line.startswith(f"{source}: {message}") for line in lines), lines
    assert "valid" not in lines[-1].rpartition(": ")[2]


def test_several_documents_are_named_by_position(tmp_path, capsys):
    source = tmp_path / "two.yaml"
    source.write_text((ROOT / "examples" / "local-tiny.yaml").read_text() + "\n---\n" + BAD["out of range"][0])
    code, out, _ = validate(capsys, "-f", str(source))
    assert code == 1
    assert out.splitlines() == [f"{source}#1: valid", f"{source}#2: spec.engine.maxNumSeqs: must be >= 1 (got 0)"]


@pytest.mark.parametrize("text, message", [
    ("model: [1, 2\n", "not valid YAML (line 2, column 1): expected ',' or ']'"),
    ("", "holds no YAML document"),
    ("\xff\xfe", "cannot read"),
])
def test_unreadable_input_is_a_clear_error(text, message, tmp_path, capsys):
    source = tmp_path / "isvc.yaml"
    source.write_bytes(text.encode("latin-1"))
    code, out, err = validate(capsys, "-f", str(source))
    assert code == 2 and out == ""
    assert err.startswith(f"tessera validate: error: {source}: {message}"), err


def test_a_missing_file_is_a_clear_error(tmp_path, capsys):
    assert validate(capsys, "-f", str(tmp_path / "nope.yaml")) == (
        2, "", f"tessera validate: error: {tmp_path / 'nope.yaml'}: no such file\n")


def test_a_crd_option_that_is_not_the_crd_is_refused(capsys):
    code, _, err = validate(capsys, "-f", str(EXAMPLES[0]), "--crd", str(EXAMPLES[0]))
    assert code == 2 and err == f"tessera validate: error: {EXAMPLES[0]}: not a CustomResourceDefinition\n"


def test_an_older_crd_is_what_gets_checked(tmp_path, capsys):
    """--crd checks against the given schema: a CRD without spec.loras refuses an adapter list."""
    manifest = yaml.safe_load(CHART_CRD.read_text())
    del manifest["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["loras"]
    older = tmp_path / "crd.yaml"
    older.write_text(yaml.safe_dump(manifest))
    lora = ROOT / "examples" / "inferenceservice-lora.yaml"
    code, out, _ = validate(capsys, "-f", str(lora), "--crd", str(older))
    assert code == 1 and out.startswith(f"{lora}: spec.loras: unknown field (known: ")


def test_the_schema_pass_finds_type_errors_on_its_own():
    bad = yaml.safe_load(BAD["wrong type"][0])
    assert schema_errors(bad, crd.openapi_schema()) == [FieldError("spec.engine.blockSize",
                                                                   "must be an integer (got str)")]


def test_the_rule_pass_finds_what_json_schema_cannot():
    bad = yaml.safe_load(BAD["CEL rule"][0])
    assert schema_errors(bad, crd.openapi_schema()) == []
    assert [str(e) for e in check(bad)] == ["spec.pools.mixed: minReplicas must not exceed maxReplicas"]


def test_structural_schema_conversion():
    schema = json_schema({
        "type": "object",
        "properties": {
            "size": {"x-kubernetes-int-or-string": True},
            "note": {"type": "string", "nullable": True},
            "free": {"type": "object", "properties": {"a": {"type": "integer"}},
                     "x-kubernetes-preserve-unknown-fields": True},
            "rules": {"type": "object", "properties": {}, "x-kubernetes-validations": [{"rule": "true"}]},
        },
    })
    validator = jsonschema.Draft4Validator(schema)
    assert validator.is_valid({"size": 3, "note": None, "free": {"a": 1, "b": "kept"}})
    assert validator.is_valid({"size": "3Gi"})
    assert not validator.is_valid({"size": 1.5})
    assert not validator.is_valid({"other": 1})
    assert not validator.is_valid({"free": {"a": "x"}})
    assert "x-kubernetes-validations" not in schema["properties"]["rules"]


def test_validate_and_render_run_without_the_engine(tmp_path):
    """Control-plane tools: with torch and engine_pod unimportable, both still work and load neither."""
    code = ("import sys\n"
            "for name in ('torch', 'engine_pod', 'xgrammar', 'triton', 'safetensors'):\n"
            "    sys.modules[name] = None\n"
            "from tessera_tools import cli\n"
            f"assert cli.main(['validate', '-f', {str(EXAMPLES[0])!r}]) == 0\n"
            f"assert cli.main(['render', '-f', {str(EXAMPLES[0])!r}, '-o', {str(tmp_path / 'out.yaml')!r}]) == 0\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{EXAMPLES[0]}: valid\n"
    assert (tmp_path / "out.yaml").read_text().count("\nkind: Deployment\n") >= 2


def test_validate_runs_as_a_subprocess_with_exit_codes():
    bad = BAD["out of range"][0]
    proc = subprocess.run([sys.executable, "-m", "tessera_tools.cli", "validate", "-f", "-"], input=bad,
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 1
    assert proc.stdout == "-: spec.engine.maxNumSeqs: must be >= 1 (got 0)\n"
