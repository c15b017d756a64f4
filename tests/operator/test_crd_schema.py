"""The CRD schema: one home, structural, and enforced the same by jsonschema and validate_inference_service."""

from __future__ import annotations

import copy

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kv_store.block_hash import DEFAULT_BLOCK_SIZE
from tessera_operator import InvalidInferenceService, crd, validate_inference_service
from tessera_operator.schema_check import json_schema
from tessera_operator.validation import RULE_CHECKS

from .conftest import CHART, EXAMPLES, load_example, make_isvc

K8S_VERSIONS = ["1.30.0", "1.37.0"]


def strict_schema() -> dict:
    """The CRD schema as kubectl's strict field validation applies it: unknown fields are errors
    (the one conversion, `tessera validate`'s)."""
    return json_schema(crd.openapi_schema())


def reference_errors(obj: dict) -> list[str]:
    validator = jsonschema.Draft4Validator(strict_schema())
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]


def test_chart_crd_is_generated_from_the_python_home():
    on_disk = (CHART / "crds" / "inferenceservices.tessera.dev.yaml").read_text()
    assert on_disk == crd.crd_yaml(), "run `python -m tessera_operator.write_crd` after editing the schema"


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_crd_validates_against_kubernetes_openapi(version):
    kubernetes_validate.validate(crd.crd_manifest(), version, strict=True)


def test_crd_shape():
    manifest = crd.crd_manifest()
    spec = manifest["spec"]
    assert manifest["metadata"]["name"] == "inferenceservices.tessera.dev"
    assert spec["scope"] == "Namespaced" and spec["versions"][0]["name"] == "v1alpha1"
    assert "isvc" not in spec["names"]["shortNames"]  # KServe's
    version = spec["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Ready"] == '.status.conditions[?(@.type=="Ready")].status'
    assert {"Prefill", "Decode", "URL", "Age"} <= set(columns)


def _walk(node, path=""):
    if isinstance(node, dict):
        yield path, node
        for key, value in node.get("properties", {}).items():
            yield from _walk(value, f"{path}.{key}")
        for key in ("items", "additionalProperties"):
            if isinstance(node.get(key), dict):
                yield from _walk(node[key], f"{path}[{key}]")


def test_schema_is_structural():
    """Every node has a type (or is int-or-string), and properties never sit next to additionalProperties."""
    for path, node in _walk(crd.openapi_schema()):
        assert "type" in node or node.get("x-kubernetes-int-or-string"), path
        assert not ("properties" in node and "additionalProperties" in node), path


def test_every_cel_rule_has_a_python_twin():
    rules = {rule["rule"] for _, node in _walk(crd.openapi_schema())
             for rule in node.get("x-kubernetes-validations", [])}
    assert rules == set(RULE_CHECKS)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate(path):
    obj = load_example(path)
    assert reference_errors(obj) == []
    validate_inference_service(obj)


def test_both_examples_exist():
    modes = {load_example(p)["spec"]["mode"] for p in EXAMPLES}
    assert modes == {"mixed", "disaggregated"}


def test_defaults_are_applied():
    out = validate_inference_service(make_isvc())
    spec = out["spec"]
    assert spec["mode"] == "mixed"
    # The block size's one home is the KV store's hash (the gateway hashes prompts with it).
    assert spec["engine"]["blockSize"] == DEFAULT_BLOCK_SIZE == 16 and spec["engine"]["prefixCaching"] is True
    assert spec["pools"]["mixed"] == {"replicas": 1, "minReplicas": 1, "maxReplicas": 4, "resources": {}}
    assert spec["autoscaling"]["decode"]["signal"] == "kvUsage"
    assert spec["autoscaling"]["mixed"]["signal"] == spec["autoscaling"]["prefill"]["signal"] == "concurrency"
    assert spec["autoscaling"]["mixed"]["targetConcurrencyPerReplica"] == 8
    assert spec["gateway"]["priorityClasses"][0]["name"] == spec["gateway"]["defaultPriorityClass"] == "standard"
    # The defaulted object is itself valid for the reference validator.
    assert reference_errors(out) == []


def test_the_kv_channel_defaults_to_redis_with_a_1gi_inbox():
    from gateway.config import KV_CHANNELS

    properties = crd.openapi_schema()["properties"]["spec"]["properties"]["disaggregation"]["properties"]
    assert properties["kvChannel"]["enum"] == list(KV_CHANNELS) and set(KV_CHANNELS) == {"redis", "direct"}
    spec = validate_inference_service(make_isvc({"mode": "disaggregated"}))["spec"]
    assert spec["disaggregation"] == {"minUncachedTokens": 256, "kvChannel": "redis", "inboxBytes": "1Gi"}


VALID_INBOXES = [0, 1 << 30, "0", "512Mi", "+2Gi", "1.5Gi", "4e9"]


@pytest.mark.parametrize("inbox", VALID_INBOXES)
def test_an_inbox_is_any_size_from_zero(inbox):
    obj = make_isvc({"mode": "disaggregated", "disaggregation": {"kvChannel": "direct", "inboxBytes": inbox}})
    assert reference_errors(obj) == []
    assert validate_inference_service(obj)["spec"]["disaggregation"]["inboxBytes"] == inbox


@pytest.mark.parametrize("role", ["mixed", "prefill", "decode"])
def test_every_pool_may_scale_on_concurrency(role):
    obj = make_isvc({"autoscaling": {role: {"signal": "concurrency", "targetConcurrencyPerReplica": 12.5}}})
    scaling = validate_inference_service(obj)["spec"]["autoscaling"][role]
    assert (scaling["signal"], scaling["targetConcurrencyPerReplica"]) == ("concurrency", 12.5)
    assert reference_errors(obj) == []


def test_input_is_not_modified():
    obj = make_isvc()
    before = copy.deepcopy(obj)
    validate_inference_service(obj)
    assert obj == before


INVALID = [
    ("negative replicas", {"pools": {"mixed": {"replicas": -1}}}, "spec.pools.mixed.replicas", True),
    ("unknown field", {"engine": {"blockSzie": 32}}, "spec.engine.blockSzie", True),
    ("wrong enum", {"mode": "hybrid"}, "spec.mode", True),
    ("wrong type", {"engine": {"maxNumSeqs": "many"}}, "spec.engine.maxNumSeqs", True),
    ("dtype enum", {"model": {"dtype": "int4"}}, "spec.model.dtype", True),
    ("memory fraction above 1", {"engine": {"gpuMemoryUtilization": 1.5}}, "spec.engine.gpuMemoryUtilization", True),
    ("bad quantity", {"kvStore": {"hostMemory": "lots"}}, "spec.kvStore.hostMemory", True),
    ("decode cannot scale on ttft", {"autoscaling": {"decode": {"signal": "ttft"}}},
     "spec.autoscaling.decode.signal", True),
    ("concurrency target below its minimum",
     {"autoscaling": {"decode": {"signal": "concurrency", "targetConcurrencyPerReplica": 0.05}}},
     "spec.autoscaling.decode.targetConcurrencyPerReplica", True),
    ("unknown scale-down rule", {"autoscaling": {"mixed": {"scaleDownStabilization": "lowest"}}},
     "spec.autoscaling.mixed.scaleDownStabilization", True),
    ("zero weight", {"gateway": {"priorityClasses": [{"name": "a", "priority": 1, "weight": 0}],
                                 "defaultPriorityClass": "a"}}, "spec.gateway.priorityClasses[0].weight", True),
    ("unknown attention backend", {"engine": {"attentionBackend": "flash"}}, "spec.engine.attentionBackend", True),
    ("speculation without a draft count", {"engine": {"speculative": {"method": "ngram"}}},
     "spec.engine.speculative.numSpeculativeTokens", True),
    ("too many drafts", {"engine": {"speculative": {"numSpeculativeTokens": 64}}},
     "spec.engine.speculative.numSpeculativeTokens", True),
    ("unknown kv channel", {"disaggregation": {"kvChannel": "rdma"}}, "spec.disaggregation.kvChannel", True),
    ("negative inbox", {"disaggregation": {"inboxBytes": "-1Gi"}}, "spec.disaggregation.inboxBytes", True),
    ("negative integer inbox", {"disaggregation": {"inboxBytes": -1}}, "spec.disaggregation.inboxBytes", True),
    ("inbox not a quantity", {"disaggregation": {"inboxBytes": "1 GB"}}, "spec.disaggregation.inboxBytes", True),
    ("unknown tool-call parser", {"model": {"toolCallParser": "mistral"}}, "spec.model.toolCallParser", True),
    ("zero redis timeout", {"kvStore": {"redis": {"urlSecretRef": {"name": "r"}, "timeoutSeconds": 0}}},
     "spec.kvStore.redis.timeoutSeconds", True),
    # Cross-field rules: CEL on the cluster, so the reference JSON Schema validator cannot see them.
    ("min above max", {"pools": {"prefill": {"minReplicas": 5, "maxReplicas": 2}}}, "spec.pools.prefill", False),
    ("two model sources", {"model": {"hostPath": {"path": "/data/llama"}}}, "spec.model", False),
    ("unknown default class", {"gateway": {"defaultPriorityClass": "gold"}}, "spec.gateway", False),
    ("lookup bounds crossed", {"engine": {"speculative": {"numSpeculativeTokens": 2, "promptLookupMin": 6}}},
     "spec.engine.speculative", False),
    ("duplicate class", {"gateway": {"priorityClasses": [{"name": "a", "priority": 1, "weight": 1},
                                                         {"name": "a", "priority": 2, "weight": 1}],
                                     "defaultPriorityClass": "a"}}, "spec.gateway.priorityClasses", False),
    # spec.batch and the engine's background scheduling.
    ("zero batch concurrency", {"batch": {"volume": {"claimName": "b"}, "maxConcurrency": 0}},
     "spec.batch.maxConcurrency", True),
    ("zero lines per batch file", {"batch": {"volume": {"claimName": "b"}, "maxLinesPerFile": 0}},
     "spec.batch.maxLinesPerFile", True),
    ("batch volume path from the root", {"batch": {"volume": {"claimName": "b", "path": "/abs"}}},
     "spec.batch.volume.path", True),
    ("batch redis without its secret", {"batch": {"redis": {"keyPrefix": "x:"}}}, "spec.batch.redis.urlSecretRef",
     True),
    ("glob in the batch key prefix", {"batch": {"redis": {"urlSecretRef": {"name": "r"}, "keyPrefix": "b*"}}},
     "spec.batch.redis.keyPrefix", True),
    ("negative background priority", {"engine": {"backgroundPriority": -1}}, "spec.engine.backgroundPriority", True),
    ("zero background tokens", {"engine": {"backgroundMaxBatchedTokens": 0}},
     "spec.engine.backgroundMaxBatchedTokens", True),
    ("batch with two stores", {"batch": {"volume": {"claimName": "b"}, "redis": {"urlSecretRef": {"name": "r"}}}},
     "spec.batch", False),
    ("batch with no store", {"batch": {"maxConcurrency": 2}}, "spec.batch", False),
    ("batch class not defined", {"batch": {"volume": {"claimName": "b"}, "priorityClass": "batch"}}, "spec", False),
    ("batch volume behind several gateways", {"gateway": {"replicas": 2}, "batch": {"volume": {"claimName": "b"}}},
     "spec", False),
    ("background priority under fcfs", {"engine": {"schedulingPolicy": "fcfs", "backgroundPriority": 20}},
     "spec.engine", False),
]


@pytest.mark.parametrize("case", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_resources_are_rejected(case):
    _, change, field, reference_sees_it = case
    obj = make_isvc(change)
    with pytest.raises(InvalidInferenceService) as info:
        validate_inference_service(obj)
    assert any(e.path == field for e in info.value.errors), str(info.value)
    assert field in str(info.value)
    assert isinstance(info.value, ValueError)
    if reference_sees_it:
        assert reference_errors(obj), "jsonschema should reject it too"


def test_missing_required_and_bad_header():
    obj = make_isvc()
    del obj["spec"]["model"]["name"]
    obj["kind"] = "Deployment"
    obj["metadata"]["name"] = "Not_A_Label"
    with pytest.raises(InvalidInferenceService) as info:
        validate_inference_service(obj)
    paths = {e.path for e in info.value.errors}
    assert {"spec.model.name", "kind"} <= paths


# "trailing\n": the API server's RE2 `$` is the end of the text, not a final newline (Python's).
BAD_NAMES = ["x" * 51, "Upper", "1starts-with-digit", "trailing\n"]


def test_long_or_odd_names_are_rejected():
    for name in BAD_NAMES:
        with pytest.raises(InvalidInferenceService, match="metadata.name"):
            validate_inference_service(make_isvc(name=name))
    validate_inference_service(make_isvc(name="a" * 50))


def test_metadata_that_is_not_a_mapping_is_an_error_not_a_crash():
    obj = make_isvc(name="ok")
    obj["metadata"] = "x"
    with pytest.raises(InvalidInferenceService, match="metadata: must be a mapping"):
        validate_inference_service(obj)


def test_yaml_file_round_trip(tmp_path):
    """What `tessera up` will do: read YAML from disk and validate it."""
    path = tmp_path / "svc.yaml"
    path.write_text(yaml.safe_dump(make_isvc({"mode": "disaggregated"})))
    out = validate_inference_service(yaml.safe_load(path.read_text()))
    assert out["spec"]["pools"]["prefill"]["maxReplicas"] == 4


# The cross-field messages of spec.batch and engine.backgroundPriority, as users read them.
CROSS_FIELD_MESSAGES = [
    ({"batch": {"maxConcurrency": 2}}, "spec.batch: set exactly one of batch.redis and batch.volume"),
    ({"batch": {"volume": {"claimName": "b"}, "priorityClass": "gold"}},
     "spec: batch.priorityClass must name one of gateway.priorityClasses"),
    ({"gateway": {"replicas": 3}, "batch": {"volume": {"claimName": "b"}}},
     "spec: batch.volume keeps files and batches in a directory that serves one gateway replica: set "
     "gateway.replicas to 1, or use batch.redis, which several replicas share"),
    ({"engine": {"schedulingPolicy": "fcfs", "backgroundPriority": 20}},
     "spec.engine: engine.backgroundPriority needs engine.schedulingPolicy priority"),
]


@pytest.mark.parametrize("change,message", CROSS_FIELD_MESSAGES, ids=[m[1].split(":")[0] + ": " + m[1][:40]
                                                                      for m in CROSS_FIELD_MESSAGES])
def test_batch_cross_field_errors_say_what_to_change(change, message):
    with pytest.raises(InvalidInferenceService) as info:
        validate_inference_service(make_isvc(change))
    assert message in str(info.value)
    assert len(info.value.errors) == 1


VALID_BATCH_SPECS = [
    {"batch": {"volume": {"claimName": "b"}}},                                   # the default classes
    {"batch": {"volume": {"claimName": "b"}, "priorityClass": "standard"}},     # a class of the default list
    {"gateway": {"replicas": 4}, "batch": {"redis": {"urlSecretRef": {"name": "r"}}}},  # Redis: many replicas
    {"engine": {"backgroundPriority": 20, "backgroundMaxBatchedTokens": 64}},   # priority is the default policy
    {"gateway": {"priorityClasses": [{"name": "standard", "priority": 10, "weight": 4},
                                     {"name": "bulk", "priority": 20, "weight": 1}]},
     "batch": {"volume": {"claimName": "b", "path": "x"}, "priorityClass": "bulk", "maxFileBytes": 1 << 20}},
]


@pytest.mark.parametrize("change", VALID_BATCH_SPECS)
def test_batch_specs_that_are_valid(change):
    obj = make_isvc(change)
    assert reference_errors(obj) == []
    validate_inference_service(obj)
