"""The InferenceService CRD: the one home of its schema (spec in crd_spec, crd_engine and crd_lora).

The chart's copy (charts/tessera/crds/) is generated from these modules
(`python -m tessera_operator.write_crd`) and a test fails when the two differ. `validate_inference_service` checks
objects against the same schema, so the operator and `tessera up` agree.
"""

from __future__ import annotations

import yaml

from tessera_operator.crd_engine import (
    MAX_PIPELINE_NAME_LENGTH,
    MAX_PREFILL_PIPELINE_NAME_LENGTH,
    POOL_NAMES,
    prefill_group_cel,
    uses_pipeline_cel,
)
from tessera_operator.crd_spec import spec_schema
from tessera_operator.schema_dsl import DNS_LABEL_PATTERN, Schema, array, integer, obj, string

GROUP = "tessera.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
# KServe owns "isvc"; ours must not shadow it in kubectl.
SHORT_NAMES = ["tisvc"]
# Longest object suffix is "-gateway" (8); Service names stop at 63 characters.
MAX_NAME_LENGTH = 50
NAME_RULE = (f"self.metadata.name.size() <= {MAX_NAME_LENGTH} && "
             f"self.metadata.name.matches('{DNS_LABEL_PATTERN}')")
# Pipeline-parallel pools are LeaderWorkerSets, whose StatefulSets' names leave less room (a
# prefill pool's, NAME-prefill-GROUP, one character less than the others').
PIPELINE_NAME_RULE = (f"!({uses_pipeline_cel('self.spec')}) || self.metadata.name.size() <= "
                      f"({prefill_group_cel('self.spec')} ? {MAX_PREFILL_PIPELINE_NAME_LENGTH} : "
                      f"{MAX_PIPELINE_NAME_LENGTH})")


def status_schema() -> Schema:
    pool_status = obj("Replicas of one pool.", {
        "desiredReplicas": integer("Replicas the operator asks for.", minimum=0),
        "readyReplicas": integer("Pods passing readiness.", minimum=0),
        "lastScaleTime": string("When the autoscaler last changed the replicas (RFC 3339)."),
    })
    condition = obj("A condition.", {
        "type": string("GatewayReady, EngineReady, PrefillReady, DecodeReady or Ready."),
        "status": string("True, False or Unknown.", enum=["True", "False", "Unknown"]),
        "reason": string("CamelCase reason."),
        "message": string("Human-readable detail."),
        "lastTransitionTime": string("When status last changed (RFC 3339)."),
        "observedGeneration": integer("Generation the condition was computed for."),
    }, required=["type", "status"])
    return obj("Observed state, written by the operator.", {
        "observedGeneration": integer("Last generation the operator reconciled."),
        "mode": string("Mode of the deployed pools."),
        "url": string("In-cluster REST endpoint of the gateway."),
        "pools": obj("Replicas of each active pool.", {name: pool_status for name in POOL_NAMES}),
        "loras": array("The LoRA adapters the pods and the gateway were given (spec.loras, by name; absent: "
                       "none). Adapters loaded at run time are not listed.", string("An adapter's name.")),
        "conditions": array("Readiness of each component and of the whole, one entry per type.", condition,
                            map_keys=["type"]),
    })


def openapi_schema() -> Schema:
    root = obj("A model served by Tessera: gateway plus engine pools.", {
        "apiVersion": string(f"{API_VERSION} (the only version so far)."),
        "kind": string(f"{KIND}."),
        "metadata": {"type": "object"},
        "spec": spec_schema(),
        "status": status_schema(),
    }, required=["spec"], rules=[(NAME_RULE, f"metadata.name must be a DNS label (lower case letters, digits, '-') "
                       f"of at most {MAX_NAME_LENGTH} characters: it names the Services"),
                                 (PIPELINE_NAME_RULE, f"metadata.name must have at most {MAX_PIPELINE_NAME_LENGTH} "
                                  f"characters with pipelineParallelSize above 1 ({MAX_PREFILL_PIPELINE_NAME_LENGTH} "
                                  "with a pipeline-parallel prefill pool): the LeaderWorkerSet's StatefulSets are "
                                  "named after it")])
    return root


def _printer_columns() -> list[dict]:
    def col(name, type_, path, description, priority=0):
        c = {"name": name, "type": type_, "jsonPath": path, "description": description}
        if priority:
            c["priority"] = priority
        return c

    return [
        col("Mode", "string", ".spec.mode", "mixed or disaggregated"),
        col("Ready", "string", '.status.conditions[?(@.type=="Ready")].status', "every component ready"),
        col("Engine", "integer", ".status.pools.mixed.readyReplicas", "ready mixed pods"),
        col("Prefill", "integer", ".status.pools.prefill.readyReplicas", "ready prefill pods"),
        col("Decode", "integer", ".status.pools.decode.readyReplicas", "ready decode pods"),
        col("URL", "string", ".status.url", "REST endpoint of the gateway"),
        col("Age", "date", ".metadata.creationTimestamp", "age"),
    ]


def crd_manifest() -> dict:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "plural": PLURAL, "singular": SINGULAR, "shortNames": SHORT_NAMES,
                      "categories": ["tessera"]},
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": _printer_columns(),
                "schema": {"openAPIV3Schema": openapi_schema()},
            }],
        },
    }


class _PlainDumper(yaml.SafeDumper):
    """No YAML anchors: sub-schemas are shared objects here, but kubectl readers want plain YAML."""

    def ignore_aliases(self, data) -> bool:
        return True


def crd_yaml() -> str:
    header = ("# Generated by `python -m tessera_operator.write_crd`; edit operator/tessera_operator/crd.py,\n"
              "# crd_spec.py, crd_engine.py or crd_lora.py instead.\n")
    return header + yaml.dump(crd_manifest(), Dumper=_PlainDumper, sort_keys=False, width=120)
