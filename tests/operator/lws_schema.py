"""Our own JSON Schema of the part of the LeaderWorkerSet API (leaderworkerset.x-k8s.io/v1) the
operator renders: NOT the upstream CRD file, which the repository does not copy. Written from the
upstream API (kubernetes-sigs/lws, api/leaderworkerset/v1/leaderworkerset_types.go and its CRD
config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml): the field names, types, enums
and required fields of the levels we write, closed (additionalProperties false) there, so a
misspelled or invented field fails. The pod templates are left open here and checked by the
Kubernetes core schema instead (`pod_template_object`: a v1 PodTemplate for kubernetes-validate).

Upstream, for the record: spec.replicas (int32, default 1), spec.leaderWorkerTemplate (required:
workerTemplate; leaderTemplate optional, size int32 >= 1 default 1, restartPolicy one of
Default, RecreateGroupOnPodRestart, RecreateGroupAfterStart, None, subGroupPolicy,
volumeClaimTemplates), spec.startupPolicy (LeaderCreated or LeaderReady), spec.rolloutStrategy
(type RollingUpdate, rollingUpdateConfiguration: partition, maxUnavailable and maxSurge as
int-or-string), spec.networkConfig (subdomainPolicy Shared or UniquePerReplica).
"""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]

API_VERSION = "leaderworkerset.x-k8s.io/v1"
KIND = "LeaderWorkerSet"
RESTART_POLICIES = ["Default", "RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None"]
STARTUP_POLICIES = ["LeaderCreated", "LeaderReady"]
SUBDOMAIN_POLICIES = ["Shared", "UniquePerReplica"]
INT32_MAX = 2**31 - 1

_INT32: Schema = {"type": "integer", "minimum": 0, "maximum": INT32_MAX}
_INT_OR_STRING: Schema = {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": r"^[0-9]+%$"}]}
# Checked whole by the Kubernetes core schema (pod_template_object); here only that it is a template.
_POD_TEMPLATE: Schema = {"type": "object", "required": ["spec"],
                         "properties": {"metadata": {"type": "object"}, "spec": {"type": "object"}},
                         "additionalProperties": False}
_OWNER_REFERENCE: Schema = {
    "type": "object", "required": ["apiVersion", "kind", "name", "uid"],
    "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"}, "name": {"type": "string"},
                   "uid": {"type": "string"}, "controller": {"type": "boolean"},
                   "blockOwnerDeletion": {"type": "boolean"}},
    "additionalProperties": False,
}
_STRING_MAP: Schema = {"type": "object", "additionalProperties": {"type": "string"}}


def _closed(properties: dict[str, Schema], required: list[str] | None = None) -> Schema:
    out: Schema = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        out["required"] = required
    return out


LWS_SCHEMA: Schema = _closed({
    "apiVersion": {"const": API_VERSION},
    "kind": {"const": KIND},
    "metadata": _closed({
        "name": {"type": "string", "minLength": 1, "maxLength": 63, "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
        "namespace": {"type": "string", "minLength": 1},
        "labels": _STRING_MAP,
        "annotations": _STRING_MAP,
        "ownerReferences": {"type": "array", "items": _OWNER_REFERENCE},
    }, required=["name", "namespace"]),
    "spec": _closed({
        "replicas": _INT32,
        "leaderWorkerTemplate": _closed({
            "leaderTemplate": _POD_TEMPLATE,
            "workerTemplate": _POD_TEMPLATE,
            "size": {**_INT32, "minimum": 1},
            "restartPolicy": {"enum": RESTART_POLICIES},
            "subGroupPolicy": _closed({
                "subGroupPolicyType": {"enum": ["LeaderWorker", "LeaderExcluded"]},
                "subGroupSize": {**_INT32, "minimum": 1},
            }),
        }, required=["workerTemplate"]),
        "rolloutStrategy": _closed({
            "type": {"enum": ["RollingUpdate"]},
            "rollingUpdateConfiguration": _closed({
                "partition": _INT32,
                "maxUnavailable": _INT_OR_STRING,
                "maxSurge": _INT_OR_STRING,
            }),
        }, required=["type"]),
        "startupPolicy": {"enum": STARTUP_POLICIES},
        "networkConfig": _closed({"subdomainPolicy": {"enum": SUBDOMAIN_POLICIES}}, required=["subdomainPolicy"]),
    }, required=["leaderWorkerTemplate"]),
}, required=["apiVersion", "kind", "metadata", "spec"])


def pod_template_object(template: dict, name: str) -> dict:
    """A template of the LeaderWorkerSet as a core v1 PodTemplate, which kubernetes-validate checks
    with the Kubernetes OpenAPI schema of its version (the check the Deployments' templates get)."""
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template}
