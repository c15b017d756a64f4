"""spec.loras and spec.engine.lora: the adapters reach the engine pods' flags and volumes (both
pools), the gateway's model list and the status; every rule is checked with a clear message."""

from __future__ import annotations

import argparse
import copy

import pytest
import yaml

from tessera_operator import InvalidInferenceService, crd_lora, validate_inference_service
from tessera_operator.handlers import on_change
from tessera_operator.reconcile import desired_objects
from tessera_operator.status import build_status

from .conftest import make_isvc
from .test_crd_schema import reference_errors
from .test_handlers import call, cluster, events  # noqa: F401  (fixtures)
from .test_reconcile import arg_value, by_key, container

# make_isvc's model is on the claim `models`, at llama-8b.
ON_MODEL_CLAIM = {"name": "sql", "pvc": {"claimName": "models", "path": "adapters/sql"}}
LORA_SPEC = {
    "loras": [
        ON_MODEL_CLAIM,
        {"name": "support/v3", "pvc": {"claimName": "team-adapters", "path": "support/v3"}},
        {"name": "chat@2", "hostPath": {"path": "/srv/adapters/chat"}},
        {"name": "legal", "pvc": {"claimName": "team-adapters", "path": "legal"}},
        {"name": "whole-claim", "pvc": {"claimName": "one-adapter"}},
    ],
    "engine": {"lora": {"maxLoras": 4, "maxLoraRank": 64, "maxCpuLoras": 8,
                        "runtimeRoots": [{"pvc": {"claimName": "team-adapters", "path": "incoming"}},
                                         {"pvc": {"claimName": "models", "path": "adapters"}},
                                         {"hostPath": {"path": "/srv/incoming"}}]}},
}


def _pod(objects: list[dict], deployment: str) -> dict:
    return by_key(objects)[("Deployment", deployment)]["spec"]["template"]["spec"]


def lora_modules(args: list[str]) -> list[str]:
    """The NAME=PATH items after --lora-modules (up to the next flag)."""
    start = args.index("--lora-modules") + 1
    end = next((i for i in range(start, len(args)) if args[i].startswith("--")), len(args))
    return args[start:end]


def lora_roots(args: list[str]) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == "--lora-root"]


def _gateway_config(objects: list[dict]) -> dict:
    return yaml.safe_load(by_key(objects)[("ConfigMap", "llama-gateway")]["data"]["gateway.yaml"])


# -- the engine pods -------------------------------------------------------------------


def test_an_adapter_on_the_model_claim_is_read_through_the_model_volume():
    objects = desired_objects(make_isvc({"loras": [ON_MODEL_CLAIM]}))
    args = container(objects, "llama-engine")["args"]
    assert lora_modules(args) == ["sql=/models/adapters/sql"]
    baseline = _pod(desired_objects(make_isvc()), "llama-engine")
    # Nothing more is mounted: the model's volume (read-only) already holds the folder.
    assert _pod(objects, "llama-engine")["volumes"] == baseline["volumes"]
    assert container(objects, "llama-engine")["volumeMounts"] == baseline["containers"][0]["volumeMounts"]


def test_every_other_source_is_one_read_only_volume_however_many_adapters_it_holds():
    objects = desired_objects(make_isvc(LORA_SPEC))
    args = container(objects, "llama-engine")["args"]
    assert lora_modules(args) == ["sql=/models/adapters/sql", "support/v3=/loras/0/support/v3",
                                  "chat@2=/loras/1", "legal=/loras/0/legal", "whole-claim=/loras/2"]
    volumes = {v["name"]: v for v in _pod(objects, "llama-engine")["volumes"]}
    assert volumes["lora-0"] == {"name": "lora-0",
                                 "persistentVolumeClaim": {"claimName": "team-adapters", "readOnly": True}}
    assert volumes["lora-1"] == {"name": "lora-1", "hostPath": {"path": "/srv/adapters/chat", "type": "Directory"}}
    assert volumes["lora-2"]["persistentVolumeClaim"] == {"claimName": "one-adapter", "readOnly": True}
    assert volumes["lora-3"]["hostPath"]["path"] == "/srv/incoming"  # a run-time root's source
    assert [n for n in volumes if n.startswith("lora-")] == ["lora-0", "lora-1", "lora-2", "lora-3"]
    mounts = [m for m in container(objects, "llama-engine")["volumeMounts"] if m["name"].startswith("lora-")]
    assert mounts == [{"name": f"lora-{i}", "mountPath": f"/loras/{i}", "readOnly": True} for i in range(4)]


def test_node_folders_beside_a_host_path_model():
    body = make_isvc({"loras": [{"name": "same", "hostPath": {"path": "/srv/tiny"}},
                                {"name": "other", "hostPath": {"path": "/srv/adapters/other"}}]})
    body["spec"]["model"] = {"name": "tiny", "hostPath": {"path": "/srv/tiny"}}
    objects = desired_objects(body)
    assert lora_modules(container(objects, "llama-engine")["args"]) == ["same=/models", "other=/loras/0"]
    assert [v["name"] for v in _pod(objects, "llama-engine")["volumes"]][:2] == ["models", "lora-0"]


def test_capacity_knobs_and_run_time_roots_become_flags():
    args = container(desired_objects(make_isvc(LORA_SPEC)), "llama-engine")["args"]
    assert "--enable-lora" in args
    assert [arg_value(args, f) for f in ("--max-loras", "--max-lora-rank", "--max-cpu-loras")] == ["4", "64", "8"]
    assert lora_roots(args) == ["/loras/0/incoming", "/models/adapters", "/loras/3"]


def test_adapters_alone_get_the_engines_defaults_spelled_out():
    args = container(desired_objects(make_isvc({"loras": [ON_MODEL_CLAIM]})), "llama-engine")["args"]
    assert arg_value(args, "--max-loras") == "1" and arg_value(args, "--max-lora-rank") == "16"
    assert "--max-cpu-loras" not in args  # the engine's own default: maxLoras
    assert lora_roots(args) == []  # no run-time loads


def test_run_time_roots_without_adapters_serve_none_from_the_start():
    spec = {"engine": {"lora": {"runtimeRoots": [{"pvc": {"claimName": "models", "path": "adapters"},
                                                  }, {"pvc": {"claimName": "models", "path": "adapters"}}]}}}
    objects = desired_objects(make_isvc(spec))
    args = container(objects, "llama-engine")["args"]
    assert "--enable-lora" in args and "--lora-modules" not in args
    assert lora_roots(args) == ["/models/adapters"]  # the same folder twice is one root
    assert "loras" not in _gateway_config(objects)["model"]  # the gateway learns run-time loads from the pods


def test_no_adapters_no_lora_flags_volumes_or_list():
    objects = desired_objects(make_isvc())
    args = container(objects, "llama-engine")["args"]
    assert not [a for a in args if "lora" in a]
    assert not [v for v in _pod(objects, "llama-engine")["volumes"] if v["name"].startswith("lora-")]
    assert "loras" not in _gateway_config(objects)["model"]


def test_both_pools_compute_with_the_adapters():
    """Disaggregated: the prefill pod computes the prompt's KV with the adapter, the decode pod goes on."""
    objects = desired_objects(make_isvc({**LORA_SPEC, "mode": "disaggregated"}))
    prefill, decode = container(objects, "llama-prefill"), container(objects, "llama-decode")
    lora_part = lora_modules(prefill["args"]) + lora_roots(prefill["args"])
    assert lora_part == lora_modules(decode["args"]) + lora_roots(decode["args"]) and len(lora_part) == 8
    assert _pod(objects, "llama-prefill")["volumes"] == _pod(objects, "llama-decode")["volumes"]
    # The gateway needs names only: it mounts no adapter.
    assert not [v for v in _pod(objects, "llama-gateway")["volumes"] if v["name"].startswith("lora-")]


def test_the_engines_parser_takes_the_lora_flags():
    from engine_pod.lora.config import LoRAConfig
    from engine_pod.server.lora_registry import parse_lora_modules
    from engine_pod.server.main import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(container(desired_objects(make_isvc(LORA_SPEC)), "llama-engine")["args"])
    assert args.enable_lora and args.role == "mixed" and args.health_port == 50062
    config = LoRAConfig(args.max_loras, args.max_lora_rank, args.max_cpu_loras)
    assert (config.max_loras, config.max_lora_rank, config.host_capacity) == (4, 64, 8)
    assert parse_lora_modules(args.lora_modules)[:2] == [("sql", "/models/adapters/sql"),
                                                         ("support/v3", "/loras/0/support/v3")]
    assert args.lora_root == ["/loras/0/incoming", "/models/adapters", "/loras/3"]


def test_changing_adapters_rolls_the_engines_and_the_gateway():
    before = by_key(desired_objects(make_isvc(LORA_SPEC)))
    spec = copy.deepcopy(LORA_SPEC)
    spec["loras"][0]["pvc"]["path"] = "adapters/sql-v2"
    after = by_key(desired_objects(make_isvc(spec)))
    assert {k for k in before if before[k] != after[k]} == {("Deployment", "llama-engine")}
    spec["loras"].append({"name": "new", "pvc": {"claimName": "models", "path": "adapters/new"}})
    after = by_key(desired_objects(make_isvc(spec)))
    assert {k for k in before if before[k] != after[k]} == {("Deployment", "llama-engine"),
                                                          ("ConfigMap", "llama-gateway"),
                                                          ("Deployment", "llama-gateway")}


# -- the gateway and the status --------------------------------------------------------


def test_the_gateway_config_lists_the_adapter_names():
    from gateway.config import gateway_config_from_dict

    config = _gateway_config(desired_objects(make_isvc(LORA_SPEC)))
    names = ["sql", "support/v3", "chat@2", "legal", "whole-claim"]
    assert config["model"]["loras"] == [{"name": n} for n in names]
    loaded = gateway_config_from_dict(config)  # the gateway's own loader takes it
    assert [lora.name for lora in loaded.model.loras] == names


def test_status_lists_the_adapters_and_clears_them(cluster, events):
    patch = call(on_change, make_isvc(LORA_SPEC), cluster)
    assert patch["status"]["loras"] == ["sql", "support/v3", "chat@2", "legal", "whole-claim"]
    # Merge patch: null removes the list an earlier spec left.
    status = build_status(validate_inference_service(make_isvc()), {}, {"mixed": 1},
                          {"loras": ["sql"]}, "2025-01-01T00:00:00Z")
    assert status["loras"] is None


# -- the schema ------------------------------------------------------------------------


def test_defaults_apply_inside_engine_lora_only():
    spec = validate_inference_service(make_isvc({"loras": [ON_MODEL_CLAIM]}))["spec"]
    assert "lora" not in spec["engine"]  # absent stays absent: the rule below needs to see it
    assert spec["loras"] == [{"name": "sql", "pvc": {"claimName": "models", "path": "adapters/sql"}}]
    spec = validate_inference_service(make_isvc({"loras": [ON_MODEL_CLAIM], "engine": {"lora": {}}}))["spec"]
    assert spec["engine"]["lora"] == {"maxLoras": 1, "maxLoraRank": 16, "runtimeRoots": []}
    assert reference_errors(make_isvc(LORA_SPEC)) == []


def _loras(*items: dict) -> dict:
    return {"loras": list(items)}


SQL = {"name": "sql", "pvc": {"claimName": "models", "path": "adapters/sql"}}
INVALID = [
    # (id, spec change, offending path, words of the message, seen by the plain JSON Schema validator)
    ("bad characters", _loras({**SQL, "name": "sql adapter"}), "spec.loras[0].name", "does not match", True),
    ("name too long", _loras({**SQL, "name": "a" * 257}), "spec.loras[0].name", "at most 256", True),
    ("empty name", _loras({**SQL, "name": ""}), "spec.loras[0].name", "at least 1", True),
    ("no name", _loras({"pvc": SQL["pvc"]}), "spec.loras[0].name", "required", True),
    ("too many adapters", _loras(*({**SQL, "name": f"a{i}"} for i in range(65))), "spec.loras", "at most 64", True),
    ("flat claim", _loras({"name": "sql", "claimName": "models"}), "spec.loras[0].claimName", "unknown field",
     True),
    ("absolute path in a claim", _loras({**SQL, "pvc": {"claimName": "m", "path": "/adapters"}}),
     "spec.loras[0].pvc.path", "does not match", True),
    ("relative host path", _loras({"name": "sql", "hostPath": {"path": "adapters"}}),
     "spec.loras[0].hostPath.path", "does not match", True),
    ("rank not offered", {"loras": [SQL], "engine": {"lora": {"maxLoraRank": 12}}},
     "spec.engine.lora.maxLoraRank", "must be one of [1, 8, 16, 32, 64, 128, 256, 320, 512]", True),
    ("no slot", {"loras": [SQL], "engine": {"lora": {"maxLoras": 0}}}, "spec.engine.lora.maxLoras", ">= 1", True),
    ("too many roots", {"engine": {"lora": {"runtimeRoots": [{"hostPath": {"path": f"/r{i}"}} for i in range(9)]}}},
     "spec.engine.lora.runtimeRoots", "at most 8", True),
    # Cross-field rules: CEL on the cluster, the Python twin here.
    ("duplicate names", _loras(SQL, {**SQL, "pvc": {"claimName": "other"}}), "spec.loras",
     "duplicate entry with {'name': 'sql'}", False),
    ("the base model's name", _loras({**SQL, "name": "llama-8b"}), "spec", "must differ from model.name", False),
    ("no source", _loras({"name": "sql"}), "spec.loras[0]", "exactly one of pvc and hostPath", False),
    ("two sources", _loras({**SQL, "hostPath": {"path": "/srv/sql"}}), "spec.loras[0]",
     "exactly one of pvc and hostPath", False),
    ("fewer host slots than device slots", {"loras": [SQL], "engine": {"lora": {"maxLoras": 4, "maxCpuLoras": 2}}},
     "spec.engine.lora", "maxCpuLoras must be at least maxLoras", False),
    ("knobs without adapters", {"engine": {"lora": {"maxLoraRank": 64}}}, "spec",
     "engine.lora needs adapters to serve", False),
    ("a root without a source", {"engine": {"lora": {"runtimeRoots": [{}]}}}, "spec.engine.lora.runtimeRoots[0]",
     "exactly one of pvc and hostPath", False),
]


@pytest.mark.parametrize("case", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_adapters_are_rejected_by_name(case):
    _, change, field, words, reference_sees_it = case
    obj = make_isvc(change)
    with pytest.raises(InvalidInferenceService) as info:
        validate_inference_service(obj)
    messages = [e.message for e in info.value.errors if e.path == field]
    assert any(words in m for m in messages), str(info.value)
    if reference_sees_it:
        assert reference_errors(obj), "jsonschema should reject it too"


def test_valid_edge_cases():
    for name in ("a", "x" * 256, "org/model:v1.2@main+fix_3-b"):
        validate_inference_service(make_isvc(_loras({**SQL, "name": name})))
    # Two names may serve the same folder, and the same claim may hold adapters and roots.
    validate_inference_service(make_isvc({**_loras(SQL, {**SQL, "name": "sql-alias"}),
                                          "engine": {"lora": {"maxLoras": 2, "maxCpuLoras": 2}}}))
    validate_inference_service(make_isvc(_loras(*({**SQL, "name": f"a{i}"} for i in range(64)))))


def test_the_schema_agrees_with_the_engine_and_the_gateway():
    """The name and rank rules come from tessera/lora.py on every side; the defaults and the
    CRD's own pattern must not drift from the engine's and from that rule."""
    from engine_pod.lora.config import LoRAConfig
    from tessera.lora import LORA_NAME_RE

    assert (crd_lora.DEFAULT_MAX_LORAS, crd_lora.DEFAULT_MAX_LORA_RANK) == (LoRAConfig.max_loras,
                                                                            LoRAConfig.max_lora_rank)
    for name in ("sql", "a" * 256, "a" * 257, "", "org/m:v1@x+y_z-1.2", "sql adapter", "sql=x", "é", "a\n"):
        try:
            validate_inference_service(make_isvc(_loras({**SQL, "name": name})))
            schema_ok = True
        except InvalidInferenceService:
            schema_ok = False
        assert schema_ok == bool(LORA_NAME_RE.fullmatch(name)), repr(name)
