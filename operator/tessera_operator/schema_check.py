"""`tessera validate`: an InferenceService checked off-cluster as the API server would check it.

Two passes. First the CRD's openAPIV3Schema with jsonschema: an independent validator of the
document the cluster holds (the operator's own schema, or a CRD file given with --crd). Then
validate_inference_service for what JSON Schema cannot say: the structural defaults the API
server applies before its CEL rules, the Python twin of each CEL rule, the keys of list-maps.
An error the first pass reported at a path is not repeated by the second.
"""

from __future__ import annotations

from typing import Any

import jsonschema

from tessera_operator import crd
from tessera_operator.validation import FieldError, InvalidInferenceService, validate_inference_service

Schema = dict[str, Any]


def crd_schema(manifest: Any) -> Schema:
    """The openAPIV3Schema of this operator's version in a CRD manifest (a chart's crds/ file)."""
    if not isinstance(manifest, dict) or manifest.get("kind") != "CustomResourceDefinition":
        raise ValueError("not a CustomResourceDefinition")
    spec = manifest.get("spec") or {}
    if spec.get("group") != crd.GROUP or (spec.get("names") or {}).get("kind") != crd.KIND:
        raise ValueError(f"not the CRD of {crd.KIND}.{crd.GROUP}")
    for version in spec.get("versions") or []:
        if version.get("name") == crd.VERSION:
            return version["schema"]["openAPIV3Schema"]
    raise ValueError(f"the CRD has no version {crd.VERSION}")


def json_schema(node: Schema) -> Schema:
    """A structural schema as JSON Schema (draft 4, which OpenAPI v3's schema object extends).

    Objects with `properties` are closed (kubectl's strict field validation rejects unknown
    fields; a structural schema may not say so itself), unless they preserve unknown fields;
    `nullable` admits null; int-or-string becomes anyOf. Other x-kubernetes-* keys (CEL rules,
    list types) have no JSON Schema form: the second pass checks them.
    """
    out = {key: value for key, value in node.items() if not key.startswith("x-kubernetes-")}
    if "properties" in out:
        out["properties"] = {name: json_schema(sub) for name, sub in out["properties"].items()}
        if not node.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = json_schema(out[key])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in out:
            out[key] = [json_schema(sub) for sub in out[key]]
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    return out


def check(obj: Any, openapi: Schema | None = None) -> list[FieldError]:
    """Every problem of `obj` as an InferenceService (none: valid), path by path.

    `openapi` is the CRD's openAPIV3Schema (default: this operator's, the chart's CRD)."""
    if not isinstance(obj, dict):
        return [FieldError("", f"not an InferenceService: a YAML mapping is needed (got {_kind_of(obj)})")]
    if obj.get("kind") != crd.KIND:
        return [FieldError("kind", f"must be {crd.KIND!r} (got {obj.get('kind')!r}): not an InferenceService")]
    errors = schema_errors(obj, crd.openapi_schema() if openapi is None else openapi)
    if not isinstance(obj.get("metadata"), dict):
        return errors or [FieldError("metadata", "required")]
    reported = {e.path for e in errors}
    try:
        validate_inference_service(obj)
    except InvalidInferenceService as e:
        errors += [err for err in e.errors if err.path not in reported]
    return errors


def schema_errors(obj: dict, openapi: Schema) -> list[FieldError]:
    """The jsonschema pass, in validate_inference_service's words."""
    validator = jsonschema.Draft4Validator(json_schema(openapi))
    errors: list[FieldError] = []
    for error in sorted(validator.iter_errors(obj), key=lambda e: [str(p) for p in e.absolute_path]):
        errors += _field_errors(error)
    return errors


def _path(parts) -> str:
    path = ""
    for part in parts:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _kind_of(value: Any) -> str:
    return {dict: "a mapping", list: "a list", str: "a string", type(None): "nothing"}.get(
        type(value), type(value).__name__)


def _field_errors(error: jsonschema.ValidationError) -> list[FieldError]:
    path, kind, limit, value = _path(error.absolute_path), error.validator, error.validator_value, error.instance
    if kind == "required":
        return [FieldError(_join(path, key), "required") for key in limit if key not in value]
    if kind == "additionalProperties":
        known = ", ".join(error.schema.get("properties", {}))
        return [FieldError(_join(path, key), f"unknown field (known: {known})")
                for key in value if key not in error.schema.get("properties", {})]
    messages = {
        "type": lambda: f"must be {'an' if str(limit)[0] in 'aeiou' else 'a'} {limit} (got {type(value).__name__})",
        "anyOf": lambda: "must be " + " or ".join(str(b.get("type")) for b in limit),
        "minimum": lambda: f"must be >= {limit} (got {value})",
        "maximum": lambda: f"must be <= {limit} (got {value})",
        "enum": lambda: f"must be one of {limit} (got {value!r})",
        "minLength": lambda: f"must have at least {limit} characters",
        "maxLength": lambda: f"must have at most {limit} characters",
        "pattern": lambda: f"{value!r} does not match {limit}",
        "maxItems": lambda: f"must have at most {limit} items",
    }
    return [FieldError(path, messages[str(kind)]() if kind in messages else error.message)]
