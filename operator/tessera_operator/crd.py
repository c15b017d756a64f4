"""The InferenceService CRD: the one home of its schema.

The chart's copy (charts/tessera/crds/) is generated from this module
(`python -m tessera_operator.write_crd`) and a test fails when the two differ. `validate_inference_service` checks
objects against the same schema, so the operator and `tessera up` agree.
"""

from __future__ import annotations

import yaml

from tessera_operator.schema_dsl import (
    Schema,
    array,
    boolean,
    integer,
    number,
    obj,
    quantity,
    secret_key_ref,
    string,
    string_map,
)

GROUP = "tessera.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
# KServe owns "isvc"; ours must not shadow it in kubectl.
SHORT_NAMES = ["tisvc"]
DEFAULT_IMAGE = "ghcr.io/tessera-ai/tessera:0.1.0"
# Longest object suffix is "-gateway" (8); Service names stop at 63 characters.
MAX_NAME_LENGTH = 50
POOL_NAMES = ("mixed", "prefill", "decode")
MIN_LE_MAX_RULE = "self.minReplicas <= self.maxReplicas"
ONE_SOURCE_RULE = "has(self.pvc) != has(self.hostPath)"
DEFAULT_CLASS_RULE = "self.priorityClasses.exists(c, c.name == self.defaultPriorityClass)"
NAME_PATTERN = "^[a-z]([-a-z0-9]*[a-z0-9])?$"
NAME_RULE = f"self.metadata.name.size() <= {MAX_NAME_LENGTH} && self.metadata.name.matches('{NAME_PATTERN}')"


def _resources() -> Schema:
    return obj("Compute resources of each pod (GPUs are added from `gpus`).", {
        "requests": string_map("Minimum resources.", quantity("A quantity.")),
        "limits": string_map("Maximum resources.", quantity("A quantity.")),
    }, default={})


def _tolerations() -> Schema:
    return array("Tolerations of the pods.", obj("A toleration.", {
        "key": string("Taint key (empty with operator Exists matches every taint)."),
        "operator": string("Exists or Equal.", enum=["Exists", "Equal"]),
        "value": string("Taint value for operator Equal."),
        "effect": string("Effect to tolerate (empty: all).",
                         enum=["", "NoSchedule", "PreferNoSchedule", "NoExecute"]),
        "tolerationSeconds": integer("How long a NoExecute taint is tolerated.", minimum=0),
    }), max_items=32)


def _pool(role: str) -> Schema:
    return obj(f"The {role} pool of engine pods.", {
        "replicas": integer("Replicas without autoscaling; the starting point with it.", default=1, minimum=0),
        "minReplicas": integer("Lower bound of the autoscaler (0 allows scale to zero).", default=1, minimum=0),
        "maxReplicas": integer("Upper bound of the autoscaler.", default=4, minimum=1),
        "gpus": integer("GPUs per pod (default: engine.tensorParallelSize; 0 runs on CPU).", minimum=0),
        "resources": _resources(),
        "nodeSelector": string_map("Node labels the pods must match."),
        "tolerations": _tolerations(),
    }, default={}, rules=[(MIN_LE_MAX_RULE, "minReplicas must not exceed maxReplicas")])


def _scaling(role: str, signals: list[str], default_signal: str) -> Schema:
    targets: dict[str, Schema] = {}
    if "queue" in signals:
        targets["targetQueuePerReplica"] = number(
            "queue: waiting requests per ready pod to aim for.", default=4, minimum=0.1)
    if "ttft" in signals:
        targets["targetTTFTSeconds"] = number(
            "ttft: mean time to first token over the last interval.", default=1.0, minimum=0.001)
    if "itl" in signals:
        targets["targetITLSeconds"] = number(
            "itl: mean inter-token latency over the last interval.", default=0.05, minimum=0.0001)
    if "kvUsage" in signals:
        targets["targetKVUsage"] = number(
            "kvUsage: mean fraction of KV blocks in use across ready pods.", default=0.8, minimum=0.05, maximum=1)
    return obj(f"Autoscaling of the {role} pool.", {
        "signal": string("The metric this pool scales on.", enum=signals, default=default_signal),
        **targets,
        "tolerance": number("No change while |observed/target - 1| is within this.", default=0.1,
                            minimum=0, maximum=0.9),
        "scaleUpStabilizationSeconds": integer(
            "Scale up to the lowest recommendation of this window.", default=0, minimum=0, maximum=3600),
        "scaleDownStabilizationSeconds": integer(
            "Scale down only to the highest recommendation of this window.", default=300, minimum=0, maximum=3600),
        "maxScaleUpStep": integer("Most pods added per decision (or doubling, if more).", default=4, minimum=1),
        "maxScaleDownStep": integer("Most pods removed per decision.", default=1, minimum=1),
    }, default={})


def _model() -> Schema:
    return obj("The model to serve.", {
        "name": string("Served model name: the OpenAI `model` field.", min_length=1, max_length=253,
                       pattern=r"^[A-Za-z0-9][A-Za-z0-9._/:-]*$"),
        "pvc": obj("Checkpoint on a PersistentVolumeClaim (ReadOnlyMany when pods span nodes).", {
            "claimName": string("Name of the PVC.", min_length=1),
            "path": string("Checkpoint folder inside the volume.", default="", pattern=r"^[^/].*$|^$"),
        }, required=["claimName"]),
        "hostPath": obj("Checkpoint in a folder of every node.", {
            "path": string("Absolute folder on the node.", pattern=r"^/"),
        }, required=["path"]),
        "dtype": string("Weights and activations dtype.", enum=["auto", "float32", "bfloat16", "float16"],
                        default="auto"),
        "maxModelLen": integer("Context length (default: from config.json).", minimum=1),
    }, required=["name"], rules=[(ONE_SOURCE_RULE, "set exactly one of model.pvc and model.hostPath")])


def _engine() -> Schema:
    return obj("Settings every engine pod shares.", {
        "tensorParallelSize": integer("GPUs one engine spans.", default=1, minimum=1, maximum=16),
        "blockSize": integer("Tokens per KV block (the gateway uses the same).", default=16, minimum=1,
                             maximum=256),
        "maxNumBatchedTokens": integer("Token budget of one engine step.", default=2048, minimum=1),
        "maxNumSeqs": integer("Most sequences running at once.", default=256, minimum=1),
        "prefixCaching": boolean("Reuse KV blocks of shared prefixes.", default=True),
        "gpuMemoryUtilization": number("Fraction of GPU memory the engine may use.", default=0.9,
                                       minimum=0.05, maximum=1),
        "schedulingPolicy": string("fcfs, or priority (the gateway's priority classes).",
                                   enum=["fcfs", "priority"], default="priority"),
        "gpuResourceName": string("Extended resource that counts GPUs.", default="nvidia.com/gpu", min_length=1),
        "drainTimeoutSeconds": integer("Seconds in-flight requests get after SIGTERM.", default=30, minimum=0,
                                       maximum=3600),
    }, default={})


def _kv_store() -> Schema:
    return obj("Tiered KV store of the engine pods.", {
        "hostMemory": quantity("Host-memory KV tier per pod (e.g. 8Gi; 0 turns it off).", default=0),
        "redis": obj("Shared Redis tier.", {
            "urlSecretRef": secret_key_ref("Secret key holding the redis:// URL (it may carry a password).",
                                           default_key="url"),
        }, required=["urlSecretRef"]),
    }, default={})


def _gateway() -> Schema:
    priority_class = obj("A priority class of the gateway's admission.", {
        "name": string("Class name tenants and requests refer to.", min_length=1, max_length=63),
        "priority": integer("Engine priority; lower runs first.", minimum=0),
        "weight": integer("Share in weighted fair queueing.", minimum=1),
        "sheddable": boolean("Rejected first (429) when saturated.", default=False),
    }, required=["name", "priority", "weight"])
    default_classes = [{"name": "standard", "priority": 10, "weight": 4, "sheddable": False}]
    return obj("The gateway: the one entry point of clients.", {
        "replicas": integer("Gateway pods (they share no state).", default=1, minimum=1),
        "serviceType": string("Type of the gateway Service.", enum=["ClusterIP", "NodePort", "LoadBalancer"],
                              default="ClusterIP"),
        "tenantsSecretRef": obj("Secret with the tenants file under the key tenants.yaml.", {
            "name": string("Name of the Secret.", min_length=1),
        }, required=["name"]),
        "priorityClasses": array("Admission classes.", priority_class, default=default_classes, max_items=16,
                                 map_keys=["name"]),
        "defaultPriorityClass": string("Class of requests that name none.", default="standard"),
        "resources": _resources(),
    }, default={}, rules=[(DEFAULT_CLASS_RULE, "defaultPriorityClass must name one of priorityClasses")])


def _autoscaling() -> Schema:
    return obj("Autoscaling of the engine pools from their metrics.", {
        "enabled": boolean("Let the operator set the pools' replicas.", default=True),
        "mixed": _scaling("mixed", ["queue", "ttft", "itl", "kvUsage"], "queue"),
        "prefill": _scaling("prefill", ["queue", "ttft"], "queue"),
        "decode": _scaling("decode", ["itl", "kvUsage"], "kvUsage"),
    }, default={})


def spec_schema() -> Schema:
    return obj("Desired state of an InferenceService.", {
        "model": _model(),
        "image": string("Image of every component.", default=DEFAULT_IMAGE, min_length=1),
        "imagePullPolicy": string("Pull policy of that image.", enum=["Always", "IfNotPresent", "Never"],
                                  default="IfNotPresent"),
        "mode": string("mixed: one pool; disaggregated: prefill and decode pools.",
                       enum=["mixed", "disaggregated"], default="mixed"),
        "engine": _engine(),
        "pools": obj("Engine pools: mixed, or prefill and decode, by mode.", {
            name: _pool(name) for name in POOL_NAMES
        }, default={}),
        "kvStore": _kv_store(),
        "gateway": _gateway(),
        "disaggregation": obj("When the gateway splits a request into prefill and decode.", {
            "minUncachedTokens": integer("Disaggregate prompts with at least this many uncached tokens.",
                                         default=256, minimum=0),
        }, default={}),
        "autoscaling": _autoscaling(),
    }, required=["model"])


def status_schema() -> Schema:
    pool_status = obj("Replicas of one pool.", {
        "desiredReplicas": integer("Replicas the operator asks for.", minimum=0),
        "readyReplicas": integer("Pods passing readiness.", minimum=0),
        "lastScaleTime": string("When the autoscaler last changed the replicas."),
    })
    condition = obj("A condition.", {
        "type": string("GatewayReady, EngineReady, PrefillReady, DecodeReady or Ready."),
        "status": string("True, False or Unknown.", enum=["True", "False", "Unknown"]),
        "reason": string("CamelCase reason."),
        "message": string("Human-readable detail."),
        "lastTransitionTime": string("When status last changed."),
        "observedGeneration": integer("Generation the condition was computed for."),
    }, required=["type", "status"])
    return obj("Observed state, written by the operator.", {
        "observedGeneration": integer("Last generation the operator reconciled."),
        "mode": string("Mode of the deployed pools."),
        "url": string("In-cluster REST endpoint of the gateway."),
        "pools": obj("Per pool replicas.", {name: pool_status for name in POOL_NAMES}),
        "conditions": array("Conditions.", condition, map_keys=["type"]),
    })


def openapi_schema() -> Schema:
    root = obj("A model served by Tessera: gateway plus engine pools.", {
        "apiVersion": {"type": "string"},
        "kind": {"type": "string"},
        "metadata": {"type": "object"},
        "spec": spec_schema(),
        "status": status_schema(),
    }, required=["spec"], rules=[(NAME_RULE, f"metadata.name must be a DNS label (lower case letters, digits, '-') "
                       f"of at most {MAX_NAME_LENGTH} characters: it names the Services")])
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
    header = "# Generated by `python -m tessera_operator.write_crd`; edit operator/tessera_operator/crd.py instead.\n"
    return header + yaml.dump(crd_manifest(), Dumper=_PlainDumper, sort_keys=False, width=120)
