"""Check an InferenceService against the CRD's schema, as the API server would.

Without a cluster (`tessera up`) nobody else applies the schema, so this
module does: structural defaults first (the API server's order), then types,
bounds, enums and unknown fields, then the cross-field rules. The CRD carries
those rules as CEL for the API server; CEL is not evaluated here, each rule
has a Python twin in RULE_CHECKS instead (a test keeps the two sets equal).

Unknown fields are errors: kubectl's strict field validation rejects them on
the cluster, and a silently dropped typo is worse locally.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tessera_operator import crd, crd_batch, crd_engine, crd_lora, crd_spec
from tessera_operator.schema_dsl import DNS_LABEL_PATTERN, ONE_SOURCE_RULE

Schema = dict[str, Any]


@dataclass(frozen=True)
class FieldError:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class InvalidInferenceService(ValueError):
    """The object breaks the CRD schema; `errors` names each offending field."""

    def __init__(self, errors: list[FieldError]) -> None:
        self.errors = errors
        super().__init__("invalid InferenceService: " + "; ".join(str(e) for e in errors))


def _name_ok(obj: dict) -> bool:
    name = (obj.get("metadata") or {}).get("name", "")
    return isinstance(name, str) and len(name) <= crd.MAX_NAME_LENGTH and pattern_matches(DNS_LABEL_PATTERN, name)


RULE_CHECKS: dict[str, Callable[[dict], bool]] = {
    crd_engine.MIN_LE_MAX_RULE: lambda pool: pool["minReplicas"] <= pool["maxReplicas"],
    ONE_SOURCE_RULE: lambda folder: ("pvc" in folder) != ("hostPath" in folder),
    crd_engine.LOOKUP_BOUNDS_RULE: lambda spec: spec["promptLookupMin"] <= spec["promptLookupMax"],
    crd_spec.TRACING_ENDPOINT_RULE: lambda tracing: pattern_matches(crd_spec.TRACING_ENDPOINT_PATTERN,
                                                                  tracing["endpoint"]),
    crd_spec.DEFAULT_CLASS_RULE: lambda gw: any(c["name"] == gw["defaultPriorityClass"] for c in gw["priorityClasses"]),
    crd.NAME_RULE: _name_ok,
    crd.PIPELINE_NAME_RULE: lambda obj: (not crd_engine.uses_pipeline(obj["spec"])
                                         or len(obj["metadata"]["name"]) <= _max_pipeline_name_length(obj["spec"])),
    crd_lora.CPU_LORAS_RULE: lambda lora: lora.get("maxCpuLoras", lora["maxLoras"]) >= lora["maxLoras"],
    crd_lora.LORA_NAMES_RULE: lambda spec: all(a["name"] != spec["model"]["name"] for a in spec.get("loras", [])),
    crd_lora.LORA_SETTINGS_RULE: lambda spec: ("lora" not in spec["engine"] or bool(spec.get("loras"))
                                               or bool(spec["engine"]["lora"]["runtimeRoots"])),
    crd_engine.BACKGROUND_POLICY_RULE: lambda engine: ("backgroundPriority" not in engine
                                                       or engine["schedulingPolicy"] == "priority"),
    crd_batch.ONE_STORE_RULE: lambda batch: ("redis" in batch) != ("volume" in batch),
    crd_batch.CLASS_RULE: lambda spec: ("priorityClass" not in spec.get("batch", {})
                                        or any(c["name"] == spec["batch"]["priorityClass"]
                                               for c in spec["gateway"]["priorityClasses"])),
    crd_batch.VOLUME_REPLICAS_RULE: lambda spec: ("volume" not in spec.get("batch", {})
                                                  or spec["gateway"]["replicas"] == 1),
}


def _max_pipeline_name_length(spec: dict) -> int:
    """crd.PIPELINE_NAME_RULE's bound: a pipeline-parallel prefill pool's name is the longest."""
    if crd_engine.prefill_group(spec):
        return crd_engine.MAX_PREFILL_PIPELINE_NAME_LENGTH
    return crd_engine.MAX_PIPELINE_NAME_LENGTH


def validate_inference_service(obj: dict) -> dict:
    """Return a copy of `obj` with schema defaults applied; raise InvalidInferenceService on error."""
    if not isinstance(obj, dict):
        raise InvalidInferenceService([FieldError("", "an InferenceService must be a mapping")])
    errors = _check_type_header(obj)
    out = copy.deepcopy(obj)
    schema = crd.openapi_schema()
    apply_defaults(out, schema)
    errors += _validate(out, schema, "")
    if errors:
        raise InvalidInferenceService(errors)
    return out


def _check_type_header(obj: dict) -> list[FieldError]:
    errors = []
    if obj.get("apiVersion") != crd.API_VERSION:
        errors.append(FieldError("apiVersion", f"must be {crd.API_VERSION!r} (got {obj.get('apiVersion')!r})"))
    if obj.get("kind") != crd.KIND:
        errors.append(FieldError("kind", f"must be {crd.KIND!r} (got {obj.get('kind')!r})"))
    metadata = obj.get("metadata")
    if not isinstance(metadata, dict):
        errors.append(FieldError("metadata", f"must be a mapping with a name (got {metadata!r})"))
    elif not isinstance(metadata.get("name"), str):
        errors.append(FieldError("metadata.name", "required"))
    return errors


def apply_defaults(value: Any, schema: Schema) -> None:
    """The API server's structural defaulting: a missing field takes its default, then nested defaults apply."""
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
        for key, item in value.items():
            sub = schema.get("properties", {}).get(key)
            if sub is None and isinstance(schema.get("additionalProperties"), dict):
                sub = schema["additionalProperties"]
            if sub is not None:
                apply_defaults(item, sub)
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            apply_defaults(item, schema["items"])


_TYPES: dict[str, Callable[[Any], bool]] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
}


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _type_error(value: Any, schema: Schema) -> str | None:
    if "anyOf" in schema:
        kinds = [branch["type"] for branch in schema["anyOf"]]
        return None if any(_TYPES[k](value) for k in kinds) else f"must be {' or '.join(kinds)}"
    kind = schema.get("type")
    if kind and not _TYPES[kind](value):
        return f"must be {'an' if kind[0] in 'aeiou' else 'a'} {kind} (got {type(value).__name__})"
    return None


def _validate(value: Any, schema: Schema, path: str) -> list[FieldError]:
    problem = _type_error(value, schema)
    if problem:
        return [FieldError(path, problem)]
    errors = [FieldError(path, m) for m in _scalar_problems(value, schema)]
    if isinstance(value, dict):
        errors += _validate_object(value, schema, path)
    elif isinstance(value, list):
        errors += _validate_array(value, schema, path)
    if not errors:
        errors += [FieldError(path, rule["message"]) for rule in schema.get("x-kubernetes-validations", [])
                   if not RULE_CHECKS[rule["rule"]](value)]
    return errors


def _scalar_problems(value: Any, schema: Schema) -> list[str]:
    problems = []
    if "enum" in schema and value not in schema["enum"]:
        problems.append(f"must be one of {schema['enum']} (got {value!r})")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if "minimum" in schema and value < schema["minimum"]:
            problems.append(f"must be >= {schema['minimum']} (got {value})")
        if "maximum" in schema and value > schema["maximum"]:
            problems.append(f"must be <= {schema['maximum']} (got {value})")
    if isinstance(value, str):
        if "minLength" in schema and len(value) < schema["minLength"]:
            problems.append(f"must have at least {schema['minLength']} characters")
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            problems.append(f"must have at most {schema['maxLength']} characters")
        if "pattern" in schema and not pattern_matches(schema["pattern"], value):
            problems.append(f"{value!r} does not match {schema['pattern']}")
    return problems


# An unescaped `$`: the API server runs patterns with Go's RE2, where `$` (without the m flag) is the
# end of the text; Python's `$` also matches before a final newline, which would let "name\n" through.
_END_ANCHOR = re.compile(r"(?<!\\)\$")


def pattern_matches(pattern: str, value: str) -> bool:
    """A CRD `pattern` as the API server applies it (a search, `$` the end of the text). The schema's
    patterns put no `$` in a character class, where this rewrite would be wrong."""
    return re.search(_END_ANCHOR.sub(r"\\Z", pattern), value) is not None


def _validate_object(value: dict, schema: Schema, path: str) -> list[FieldError]:
    errors = [FieldError(_join(path, key), "required") for key in schema.get("required", []) if key not in value]
    props = schema.get("properties")
    extra = schema.get("additionalProperties")
    for key, item in value.items():
        if props is not None and key in props:
            errors += _validate(item, props[key], _join(path, key))
        elif isinstance(extra, dict):
            errors += _validate(item, extra, _join(path, key))
        elif props is not None:
            errors.append(FieldError(_join(path, key), f"unknown field (known: {', '.join(props)})"))
    return errors


def _validate_array(value: list, schema: Schema, path: str) -> list[FieldError]:
    errors = []
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        errors.append(FieldError(path, f"must have at most {schema['maxItems']} items"))
    for i, item in enumerate(value):
        errors += _validate(item, schema["items"], f"{path}[{i}]")
    keys = schema.get("x-kubernetes-list-map-keys")
    if keys and not errors:
        seen = [tuple(item.get(k) for k in keys) for item in value]
        dupes = sorted({k for k in seen if seen.count(k) > 1}, key=str)
        errors += [FieldError(path, f"duplicate entry with {dict(zip(keys, d))}") for d in dupes]
    return errors
