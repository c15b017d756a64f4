"""The CRD's CEL rules evaluated with cel-python (tests/operator/cel_rules.py) on every example and
every case of the schema tests, each against its Python twin (validation.RULE_CHECKS), so the rules
the API server runs and the ones `tessera up`/`tessera validate` run are the same rules.

No rule of the CRD reads `oldSelf` (no transition rule): every rule runs on creates and updates
alike, and a test below fails when one is added, until it comes with update cases here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import yaml

from tessera_operator import InvalidInferenceService, validate_inference_service
from tessera_operator.validation import RULE_CHECKS

from . import test_crd_schema, test_loras
from .cel_rules import CelRules, Failure, Rule, RuleCompileError
from .conftest import CHART, REPO, load_example, make_isvc

CHART_CRD = CHART / "crds" / "inferenceservices.tessera.dev.yaml"
SCHEMA = yaml.safe_load(CHART_CRD.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
RULES = CelRules(SCHEMA)
RULE_MESSAGES = {rule.message for rule in RULES.rules}
EXAMPLES = sorted([*(REPO / "examples").glob("inferenceservice-*.yaml"), *(REPO / "examples").glob("local*.yaml")])
TRACING = "http://otel-collector.observability:4317"


@dataclass(frozen=True)
class Case:
    id: str
    doc: dict
    refused: bool                  # validate_inference_service refuses it (for any reason)
    message: str | None = None     # "path: message" a rule must give (a prefix of it)
    extra: dict[str, Any] = field(default_factory=dict)


def _cases() -> list[Case]:
    cases = [Case(f"schema: {name}", make_isvc(change), True) for name, change, *_ in test_crd_schema.INVALID]
    cases += [Case(f"schema: name {name!r}", make_isvc(name=name), True, "metadata.name must be a DNS label")
              for name in test_crd_schema.BAD_NAMES]
    cases += [Case(f"schema: message {message[:50]}", make_isvc(change), True, message)
              for change, message in test_crd_schema.CROSS_FIELD_MESSAGES]
    cases += [Case(f"loras: {name}", make_isvc(change), True) for name, change, *_ in test_loras.INVALID]
    # Rule locations the tables above do not refuse: each pool's bounds, the tracing endpoint.
    cases += [Case(f"min above max in {pool}", make_isvc({"pools": {pool: {"minReplicas": 3, "maxReplicas": 2}}}),
                   True, f"spec.pools.{pool}: minReplicas must not exceed maxReplicas")
              for pool in ("mixed", "prefill", "decode")]
    cases += [Case(f"tracing endpoint {endpoint!r}", make_isvc({"tracing": {"endpoint": endpoint}}), True,
                   "spec.tracing: tracing.endpoint must be an OTLP/gRPC URL")
              for endpoint in ("otel-collector:4317", "http://otel-collector:4318/v1/traces", "https://otel:4317/\n",
                               "http://otel\n:4317", "http://otel\t:4317", "grpc://otel:4317", "http://a b:4317")]
    # Valid: both refuse nothing.
    cases += [Case("schema: the minimal resource", make_isvc(), False),
              Case("schema: a 50-character name", make_isvc(name="a" * 50), False),
              Case("tracing endpoint", make_isvc({"tracing": {"endpoint": TRACING}}), False),
              Case("tracing endpoint with a slash", make_isvc({"tracing": {"endpoint": "https://otel:4317/"}}),
                   False)]
    cases += [Case(f"schema: valid batch {i}", make_isvc(change), False)
              for i, change in enumerate(test_crd_schema.VALID_BATCH_SPECS)]
    cases += [Case(f"schema: inbox {inbox!r}", make_isvc({"mode": "disaggregated", "disaggregation": {
        "kvChannel": "direct", "inboxBytes": inbox}}), False) for inbox in test_crd_schema.VALID_INBOXES]
    cases += [Case(f"example {path.name}", load_example(path), False) for path in EXAMPLES]
    cases += [Case(f"pipeline parallel: {name}", make_isvc(change), False) for name, change in PIPELINE_CASES]
    cases += [Case("pipeline parallel: a 40-character name", make_isvc(PP2, name="a" * 40), False),
              Case("pipeline parallel: a 41-character name", make_isvc(PP2, name="a" * 41), True,
                   "metadata.name must have at most 40 characters with pipelineParallelSize above 1"),
              Case("a 41-character name without pipeline parallelism", make_isvc(name="a" * 41), False)]
    # A pipeline-parallel prefill pool's StatefulSets (NAME-prefill-GROUP) take one character more.
    cases += [Case(f"pipeline parallel: a {len(name)}-character name, {what}", make_isvc(change, name=name), refused,
                   PIPELINE_NAME_MESSAGE if refused else None)
              for what, change in PREFILL_GROUPS.items() for name, refused in (("a" * 39, False), ("a" * 40, True))]
    cases += [Case(f"pipeline parallel: a 40-character name, {what}", make_isvc(change, name="a" * 40), False)
              for what, change in NO_PREFILL_GROUP.items()]
    return cases


PP2 = {"engine": {"pipelineParallelSize": 2}}
REDIS = {"urlSecretRef": {"name": "r"}}
# (what, change): the KV store and disaggregation under pipeline parallelism, which the engine runs (the
# leader assembles whole blocks from every stage's share); no rule refuses them any more (each was once).
PIPELINE_CASES = [
    ("engine P 2", PP2),
    ("the mixed pool's P 3, TP 2", {"pools": {"mixed": {"pipelineParallelSize": 3, "tensorParallelSize": 2}}}),
    ("P 1 beside the KV store", {"engine": {"pipelineParallelSize": 1},
                                 "kvStore": {"hostMemory": "8Gi", "redis": REDIS}}),
    ("engine P 2 with every pool at 1, and Redis",
     {**PP2, "pools": {"mixed": {"pipelineParallelSize": 1}}, "kvStore": {"redis": REDIS}}),
    ("with kvStore.redis", {**PP2, "kvStore": {"redis": REDIS}}),
    ("with host memory 8Gi", {**PP2, "kvStore": {"hostMemory": "8Gi"}}),
    ("with host memory 1 byte", {"pools": {"mixed": {"pipelineParallelSize": 2}}, "kvStore": {"hostMemory": 1}}),
    ("with host memory 1e3", {**PP2, "kvStore": {"hostMemory": "1e3"}}),
    ("with loras", {**PP2, "loras": [{"name": "sql", "pvc": {"claimName": "models", "path": "sql"}}]}),
    ("with engine.lora", {**PP2, "engine": {"pipelineParallelSize": 2, "lora": {"runtimeRoots": [
        {"pvc": {"claimName": "models", "path": "adapters"}}]}}}),
    ("disaggregated decode pool", {"mode": "disaggregated", "kvStore": {"redis": REDIS},
                                   "pools": {"decode": {"pipelineParallelSize": 2}}}),
    ("disaggregated, direct channel", {**PP2, "mode": "disaggregated", "disaggregation": {"kvChannel": "direct"}}),
    ("disaggregated, prefill P 2 x TP 2, decode P 2, host memory, Redis, direct channel", {
        "mode": "disaggregated", "kvStore": {"hostMemory": "8Gi", "redis": REDIS},
        "disaggregation": {"kvChannel": "direct"},
        "pools": {"prefill": {"pipelineParallelSize": 2, "tensorParallelSize": 2},
                  "decode": {"pipelineParallelSize": 2, "tensorParallelSize": 1}}}),
]
PIPELINE_NAME_MESSAGE = "metadata.name must have at most 40 characters with pipelineParallelSize above 1 (39 with"
PREFILL_GROUPS = {
    "the prefill pool's P 2": {"mode": "disaggregated", "pools": {"prefill": {"pipelineParallelSize": 2}}},
    "the engine's P 2, disaggregated": {**PP2, "mode": "disaggregated"},
}
# Some P above 1, but no prefill LeaderWorkerSet: the other pools' names are one character shorter.
NO_PREFILL_GROUP = {
    "the decode pool's P 2": {"mode": "disaggregated", "pools": {"decode": {"pipelineParallelSize": 2}}},
    "the engine's P 2, the prefill pool's 1": {**PP2, "mode": "disaggregated",
                                               "pools": {"prefill": {"pipelineParallelSize": 1}}},
    "mixed, an unused prefill pool at P 2": {"pools": {"mixed": {"pipelineParallelSize": 2},
                                                       "prefill": {"pipelineParallelSize": 2}}},
}
CASES = _cases()


def _twin(rule: Rule, value: Any) -> bool:
    """The Python twin's verdict; an exception (a missing field, a type error) refuses, as CEL's errors do."""
    try:
        return bool(RULE_CHECKS[rule.text](value))
    except (KeyError, TypeError, AttributeError):
        return False


def _twin_errors(doc: dict) -> list:
    try:
        validate_inference_service(doc)
    except InvalidInferenceService as exc:
        return exc.errors
    return []


def test_every_rule_compiles():
    """Parsed by celpy and type-checked against the schema (fields, variables, functions)."""
    assert RULES.rules, "no x-kubernetes-validations found"
    assert RULES.compile_errors == {}, "\n".join(RULES.compile_errors.values())


def test_every_rule_of_the_crd_is_found():
    """Counted independently of cel_rules' walk: every x-kubernetes-validations entry anywhere in the CRD."""
    def count(node: Any) -> int:
        if isinstance(node, dict):
            return len(node.get("x-kubernetes-validations", [])) + sum(count(v) for v in node.values())
        if isinstance(node, list):
            return sum(count(v) for v in node)
        return 0

    assert len(RULES.rules) == count(SCHEMA)
    assert {rule.text for rule in RULES.rules} == set(RULE_CHECKS)


def test_no_rule_is_a_transition_rule():
    """A rule reading oldSelf runs on updates only: it needs cases with a previous object here."""
    assert [str(rule) for rule in RULES.rules if rule.transition] == []


@pytest.mark.parametrize("text, problem", [
    ("self.minReplica <= self.maxReplicas", "undefined field 'minReplica'"),
    ("self.pools.mixed.minReplicas <= self.maxReplicas", "undefined field 'pools'"),
    ("isQuantity(self.minReplicas)", "unknown function 'isQuantity'"),
    ("replicas > 0", "undeclared reference to 'replicas'"),
    ("self.minReplicas <= ", "does not parse"),
])
def test_a_rule_that_does_not_compile_is_named(text, problem):
    pool = SCHEMA["properties"]["spec"]["properties"]["pools"]["properties"]["mixed"]
    with pytest.raises(RuleCompileError, match="spec.pools.mixed: ") as info:
        RULES.compile(Rule("spec.pools.mixed", text, "m", False), pool)
    assert problem in str(info.value)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_passes_every_rule(path):
    doc = load_example(path)
    outcomes = RULES.evaluate(doc)
    assert [f"{o.path}: {o.rule.text}: {o.error or 'false'}" for o in outcomes if not o.passed] == []
    assert {o.rule.path for o in outcomes} >= {"", "spec", "spec.model", "spec.engine", "spec.gateway"}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_cel_agrees_with_the_python_twins(case):
    outcomes = RULES.evaluate(case.doc)
    # Rule by rule, on every node it applies to.
    disagree = [f"{o.path}: {o.rule.text}: CEL {o.passed} ({o.error}), twin {_twin(o.rule, o.value)}"
                for o in outcomes if o.passed != _twin(o.rule, o.value)]
    assert disagree == []
    # As the user reads it: CEL's refusals are the twins' (which validation reports once a node's own
    # fields are valid), same path and message.
    cel = {(o.path, o.rule.message) for o in outcomes if not o.passed}
    errors = _twin_errors(case.doc)
    assert bool(errors) == case.refused
    twin = {(e.path, e.message) for e in errors if e.message in RULE_MESSAGES}
    assert twin <= cel
    if all(e.message in RULE_MESSAGES for e in errors):
        assert cel == twin
    if case.message:
        assert any(str(Failure(p, m)).startswith(case.message) for p, m in cel), cel


def test_every_rule_is_exercised_both_ways():
    """Each rule (at each place it sits) refuses at least one case and passes at least one, so a rule
    added without cases is noticed."""
    refused, passed = set(), set()
    for case in CASES:
        for outcome in RULES.evaluate(case.doc):
            (passed if outcome.passed else refused).add(outcome.rule)
    assert [str(r) for r in RULES.rules if r not in refused] == [], "rules no case refuses"
    assert [str(r) for r in RULES.rules if r not in passed] == [], "rules no case passes"


def test_values_reach_cel_with_kubernetes_types():
    """int64 integers, doubles for `number` even when written as integers, unknown fields pruned,
    nulls pruned then defaulted, root metadata limited to name and generateName."""
    from celpy import celtypes

    from .cel_rules import prepare, to_cel

    doc = make_isvc({"pools": {"mixed": {"minReplicas": None, "bogus": 1}},
                     "autoscaling": {"mixed": {"signal": "concurrency", "targetConcurrencyPerReplica": 8}}})
    value = to_cel(prepare(doc, SCHEMA), SCHEMA, is_root=True)
    mixed = value["spec"]["pools"]["mixed"]
    assert type(mixed["minReplicas"]) is celtypes.IntType and mixed["minReplicas"] == 1  # null: defaulted
    assert "bogus" not in mixed
    target = value["spec"]["autoscaling"]["mixed"]["targetConcurrencyPerReplica"]
    assert type(target) is celtypes.DoubleType
    assert set(value["metadata"]) == {"name"}
    # Past int64: refused (the API server cannot decode it), by every rule whose self holds it.
    outcomes = RULES.evaluate(make_isvc({"pools": {"mixed": {"maxReplicas": 1 << 63}}}))
    assert sorted(o.path for o in outcomes if not o.passed) == ["", "", "spec", "spec", "spec", "spec",
                                                                  "spec.pools.mixed"]


def test_transition_rules_run_on_updates_where_the_old_value_exists():
    """The helper's oldSelf handling, on a schema of its own (the CRD has no transition rule)."""
    schema = {"type": "object", "properties": {"items": {
        "type": "array", "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"],
        "items": {"type": "object", "properties": {"name": {"type": "string"}, "size": {"type": "integer"}},
                  "x-kubernetes-validations": [{"rule": "self.size >= oldSelf.size", "message": "cannot shrink"}]},
    }}}
    rules = CelRules(schema)
    assert rules.compile_errors == {} and [r.transition for r in rules.rules] == [True]
    new = {"items": [{"name": "a", "size": 1}, {"name": "b", "size": 5}]}
    assert rules.failures(new) == []  # a create: no transition rule runs
    old = {"items": [{"name": "b", "size": 2}, {"name": "a", "size": 2}]}
    assert [str(f) for f in rules.failures(new, old=old)] == ["items[0]: cannot shrink"]  # correlated by name
