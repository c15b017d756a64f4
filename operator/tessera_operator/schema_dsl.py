"""Small constructors for the OpenAPI v3 (structural) schema of a CRD.

They keep the CRD's modules (crd, crd_spec, crd_engine) readable: one line
per field, with its type, bounds, default and description side by side.
"""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]

# Kubernetes' own pattern for resource quantities ("500m", "8Gi", "1e3"), its sign apart.
_UNSIGNED_QUANTITY = (
    r"(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
QUANTITY_PATTERN = r"^(\+|-)?" + _UNSIGNED_QUANTITY
# A size in bytes: a quantity without the minus sign (a negative one has no meaning).
SIZE_PATTERN = r"^\+?" + _UNSIGNED_QUANTITY
# A DNS label: object and namespace names.
DNS_LABEL_PATTERN = "^[a-z]([-a-z0-9]*[a-z0-9])?$"
# A folder is on a PersistentVolumeClaim or on the node, never both (model, adapters).
ONE_SOURCE_RULE = "has(self.pvc) != has(self.hostPath)"
_UNSET = object()


def _field(schema: Schema, description: str, default: Any) -> Schema:
    schema["description"] = description
    if default is not _UNSET:
        schema["default"] = default
    return schema


def string(description: str, *, default: Any = _UNSET, enum: list[str] | None = None,
           pattern: str | None = None, min_length: int | None = None, max_length: int | None = None) -> Schema:
    s: Schema = {"type": "string"}
    if enum is not None:
        s["enum"] = enum
    if pattern is not None:
        s["pattern"] = pattern
    if min_length is not None:
        s["minLength"] = min_length
    if max_length is not None:
        s["maxLength"] = max_length
    return _field(s, description, default)


def integer(description: str, *, default: Any = _UNSET, minimum: int | None = None,
            maximum: int | None = None, enum: list[int] | None = None) -> Schema:
    s: Schema = {"type": "integer", "format": "int64"}
    if enum is not None:
        s["enum"] = enum
    if minimum is not None:
        s["minimum"] = minimum
    if maximum is not None:
        s["maximum"] = maximum
    return _field(s, description, default)


def number(description: str, *, default: Any = _UNSET, minimum: float | None = None,
           maximum: float | None = None) -> Schema:
    s: Schema = {"type": "number"}
    if minimum is not None:
        s["minimum"] = minimum
    if maximum is not None:
        s["maximum"] = maximum
    return _field(s, description, default)


def boolean(description: str, *, default: Any = _UNSET) -> Schema:
    return _field({"type": "boolean"}, description, default)


def quantity(description: str, *, default: Any = _UNSET) -> Schema:
    """A Kubernetes quantity: an integer or a string such as "8Gi"."""
    s: Schema = {
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "pattern": QUANTITY_PATTERN,
        "x-kubernetes-int-or-string": True,
    }
    return _field(s, description, default)


def size(description: str, *, default: Any = _UNSET) -> Schema:
    """A size in bytes as a Kubernetes quantity ("8Gi" or an integer), never negative: the
    pattern holds strings to it, `minimum` integers."""
    s: Schema = {
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "pattern": SIZE_PATTERN,
        "minimum": 0,
        "x-kubernetes-int-or-string": True,
    }
    return _field(s, description, default)


def string_map(description: str, values: Schema | None = None) -> Schema:
    """A map with free keys (labels, node selectors, resource lists)."""
    return {"type": "object", "description": description,
            "additionalProperties": values or {"type": "string"}}


def array(description: str, items: Schema, *, default: Any = _UNSET, max_items: int | None = None,
          map_keys: list[str] | None = None) -> Schema:
    s: Schema = {"type": "array", "items": items}
    if max_items is not None:
        s["maxItems"] = max_items
    if map_keys:
        # A list keyed by these fields: the API server rejects duplicate keys.
        s["x-kubernetes-list-type"] = "map"
        s["x-kubernetes-list-map-keys"] = map_keys
    return _field(s, description, default)


def obj(description: str, properties: dict[str, Schema], *, required: list[str] | None = None,
        default: Any = _UNSET, rules: list[tuple[str, str]] | None = None) -> Schema:
    """An object with known fields; rules are (CEL rule, message) pairs."""
    s: Schema = {"type": "object", "properties": properties}
    if required:
        s["required"] = required
    if rules:
        s["x-kubernetes-validations"] = [{"rule": rule, "message": msg} for rule, msg in rules]
    return _field(s, description, default)


def secret_key_ref(description: str, default_key: str) -> Schema:
    return obj(description, {
        "name": string("Name of the Secret, in the InferenceService's namespace.", min_length=1),
        "key": string("Key in the Secret.", default=default_key, min_length=1),
    }, required=["name"])


def resources(description: str) -> Schema:
    """A container's requests and limits."""
    return obj(description, {
        "requests": string_map("Resources the scheduler reserves, by name (cpu, memory, ...).",
                               quantity("A quantity.")),
        "limits": string_map("Most the container may use, by name (cpu, memory, ...).", quantity("A quantity.")),
    }, default={})


def folder_sources(pvc_description: str, path_description: str, host_description: str,
                   host_path_description: str) -> dict[str, Schema]:
    """Where a folder lives, as the model's checkpoint says it: `pvc` (a claim and a path inside it)
    or `hostPath` (a node's folder); the object holding them carries ONE_SOURCE_RULE."""
    return {
        "pvc": pvc_source(pvc_description, path_description),
        "hostPath": obj(host_description, {
            "path": string(host_path_description, pattern=r"^/"),
        }, required=["path"]),
    }


def pvc_source(description: str, path_description: str) -> Schema:
    """A folder on a PersistentVolumeClaim: the claim and a path inside it (model.pvc's shape)."""
    return obj(description, {
        "claimName": string("Name of the PVC, in the InferenceService's namespace.", min_length=1),
        "path": string(path_description, default="", pattern=r"^[^/].*$|^$"),
    }, required=["claimName"])
