"""The InferenceService CRD: the one home of its schema.

The chart's copy (charts/tessera/crds/) is generated from this module
(`python -m tessera_operator.write_crd`) and a test fails when the two differ. `validate_inference_service` checks
objects against the same schema, so the operator and `tessera up` agree.
"""

from __future__ import annotations

import yaml

from tessera.internal_secret import SECRET_KEY
from tessera.roles import POD_ROLES
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
POOL_NAMES = POD_ROLES  # one pool per engine pod role
# The engine's own choices (the operator does not import the engine, which
# pulls in torch); tests/operator/test_reconcile.py checks they agree.
ATTENTION_BACKENDS = ("auto", "torch", "triton", "cpu")
SPEC_METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 32
MIN_LE_MAX_RULE = "self.minReplicas <= self.maxReplicas"
ONE_SOURCE_RULE = "has(self.pvc) != has(self.hostPath)"
LOOKUP_BOUNDS_RULE = "self.promptLookupMin <= self.promptLookupMax"
# The KV store keys whole blocks, not per-rank shards: the engine refuses TP > 1 with Redis.
TP_REDIS_RULE = "self.engine.tensorParallelSize == 1 || !has(self.kvStore.redis)"
DEFAULT_CLASS_RULE = "self.priorityClasses.exists(c, c.name == self.defaultPriorityClass)"
NAME_PATTERN = "^[a-z]([-a-z0-9]*[a-z0-9])?$"
# A namespace name (DNS label, at most 63 characters).
NAMESPACE_PATTERN = NAME_PATTERN
DEFAULT_REDIS_PORT = 6379
NAME_RULE = f"self.metadata.name.size() <= {MAX_NAME_LENGTH} && self.metadata.name.matches('{NAME_PATTERN}')"


def _resources(description: str) -> Schema:
    return obj(description, {
        "requests": string_map("Resources the scheduler reserves, by name (cpu, memory, ...).",
                               quantity("A quantity.")),
        "limits": string_map("Most the container may use, by name (cpu, memory, ...).", quantity("A quantity.")),
    }, default={})


def _tolerations() -> Schema:
    return array("Tolerations of the pods.", obj("A toleration.", {
        "key": string("Taint key (empty with operator Exists matches every taint)."),
        "operator": string("Exists or Equal.", enum=["Exists", "Equal"]),
        "value": string("Taint value for operator Equal."),
        "effect": string("Effect to tolerate (empty: all).",
                         enum=["", "NoSchedule", "PreferNoSchedule", "NoExecute"]),
        "tolerationSeconds": integer("How long a NoExecute taint is tolerated (absent: forever).", minimum=0),
    }), max_items=32)


def _pool() -> Schema:
    return obj("A pool of engine pods; its key is their role (mixed, prefill or decode).", {
        "replicas": integer("Pods of the pool without autoscaling; the starting count with it.", default=1,
                            minimum=0),
        "minReplicas": integer("Lower bound of the autoscaler (0 allows scale to zero).", default=1, minimum=0),
        "maxReplicas": integer("Upper bound of the autoscaler.", default=4, minimum=1),
        "gpus": integer("GPUs per pod (default: engine.tensorParallelSize; 0 runs on CPU).", minimum=0),
        "resources": _resources("CPU and memory of each engine pod (GPUs come from `gpus`); memory must hold "
                                "the process plus kvStore.hostMemory."),
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
        "signal": string("The metric this pool scales on; its target is the matching target field.",
                         enum=signals, default=default_signal),
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
        "name": string("Served model name: the `model` field of requests, and what /v1/models lists.",
                       min_length=1, max_length=253,
                       pattern=r"^[A-Za-z0-9][A-Za-z0-9._/:-]*$"),
        "pvc": obj("Checkpoint on a PersistentVolumeClaim (ReadOnlyMany when pods span nodes).", {
            "claimName": string("Name of the PVC, in the InferenceService's namespace.", min_length=1),
            "path": string("Checkpoint folder inside the volume, relative to its root (empty: the root).",
                           default="", pattern=r"^[^/].*$|^$"),
        }, required=["claimName"]),
        "hostPath": obj("Checkpoint in a folder present on every node (single-node clusters; the local "
                        "machine's folder for `tessera up`).", {
            "path": string("Absolute path of the checkpoint folder (config.json, safetensors, tokenizer files).",
                           pattern=r"^/"),
        }, required=["path"]),
        "dtype": string("Weights and activations dtype. auto: the checkpoint's on GPUs; on CPUs bfloat16 for a "
                        "bfloat16 checkpoint where the CPU has bf16 arithmetic, else float32.",
                        enum=["auto", "float32", "bfloat16", "float16"],
                        default="auto"),
        "maxModelLen": integer("Context length in tokens, prompt plus output (default: config.json's "
                               "max_position_embeddings).", minimum=1),
    }, required=["name"], rules=[(ONE_SOURCE_RULE, "set exactly one of model.pvc and model.hostPath")])


def _engine() -> Schema:
    return obj("Settings every engine pod shares.", {
        "tensorParallelSize": integer("GPUs one engine spans (tensor parallelism: one worker process per rank).",
                                      default=1, minimum=1, maximum=16),
        "blockSize": integer("Tokens per KV block; the gateway hashes prompts in blocks of the same size.",
                             default=16, minimum=1, maximum=256),
        "maxNumBatchedTokens": integer("Token budget of one engine step (decodes plus prefill chunks).",
                                       default=2048, minimum=1),
        "maxNumSeqs": integer("Most sequences one engine runs at once.", default=256, minimum=1),
        "prefixCaching": boolean("Reuse the KV blocks of shared prompt prefixes (the KV store needs it).",
                                 default=True),
        "gpuMemoryUtilization": number("Fraction of GPU memory the engine may use; the KV cache gets what the "
                                       "weights and activations leave (on CPU the KV cache gets 1 GiB).",
                                       default=0.9, minimum=0.05, maximum=1),
        "schedulingPolicy": string("fcfs: arrival order; priority: the gateway's priority classes, lower first.",
                                   enum=["fcfs", "priority"], default="priority"),
        "gpuResourceName": string("Extended resource that counts GPUs (the device plugin's name).",
                                  default="nvidia.com/gpu", min_length=1),
        "drainTimeoutSeconds": integer("Seconds in-flight requests get to finish after SIGTERM; the pods' "
                                       "termination grace period follows from it.", default=30, minimum=0,
                                       maximum=3600),
        "stepTimeoutSeconds": integer("Seconds one engine step may run before the pod reports itself stalled "
                                      "(the gateway ends its streams and routes around it; health turns "
                                      "NOT_SERVING until the step ends). Raise it for large models on CPU, "
                                      "where one long prefill step can take minutes; 0: never.",
                                      default=60, minimum=0, maximum=86400),
        "attentionBackend": string("auto: triton kernels on GPUs, the C++ cpu kernels on CPUs (torch where "
                                   "either cannot run); torch, triton or cpu to force one (one that cannot "
                                   "run fails the pod at start-up).",
                                   enum=list(ATTENTION_BACKENDS), default="auto"),
        "speculative": _speculative(),
    }, default={})


def _speculative() -> Schema:
    return obj("Speculative decoding (off when absent): n-gram drafts from the request's own context, "
               "verified in the same forward; greedy outputs are unchanged.", {
        "method": string("Draft method.", enum=list(SPEC_METHODS), default="ngram"),
        "numSpeculativeTokens": integer("Drafts proposed per request and step.", minimum=1,
                                        maximum=MAX_SPECULATIVE_TOKENS),
        "promptLookupMin": integer("Shortest context suffix matched to find drafts.", default=2, minimum=1),
        "promptLookupMax": integer("Longest context suffix matched to find drafts.", default=4, minimum=1),
    }, required=["numSpeculativeTokens"],
        rules=[(LOOKUP_BOUNDS_RULE, "promptLookupMin must not exceed promptLookupMax")])


def _kv_store() -> Schema:
    return obj("Tiered KV store of the engine pods: KV blocks kept beyond the GPU's cache.", {
        "hostMemory": quantity("Host-memory KV tier of each engine pod, in bytes (e.g. 8Gi; 0 turns it off).",
                               default=0),
        "redis": obj("Redis tier shared by every engine pod of the model; disaggregated mode hands KV from "
                     "prefill to decode pods through it.", {
            "urlSecretRef": secret_key_ref("Secret key holding the redis:// or rediss:// URL (it may carry a "
                                           "password); the engine pods get it as an environment variable, "
                                           "never on their command line.",
                                           default_key="url"),
            "tls": _redis_tls(),
            "podSelector": string_map("Labels of the Redis pods (in this namespace): a NetworkPolicy then "
                                      "admits only this InferenceService's engine pods to them, on `port` "
                                      "(absent: no policy for Redis). The policy isolates those pods: "
                                      "replication or monitoring traffic to them needs a policy of its own."),
            "port": integer("Redis's port, for that NetworkPolicy.", default=DEFAULT_REDIS_PORT, minimum=1,
                            maximum=65535),
        }, required=["urlSecretRef"]),
    }, default={})


def _redis_tls() -> Schema:
    return obj("TLS files for a rediss:// URL, from Secrets mounted read-only into the engine pods (absent: "
               "the system's CAs, no client certificate). With cert-manager, both refs can name the one "
               "Certificate Secret (ca.crt, tls.crt, tls.key).", {
        "caSecretRef": secret_key_ref("Secret key holding the CA bundle that signs the Redis server's "
                                      "certificate.", default_key="ca.crt"),
        "clientCertSecretRef": obj("A kubernetes.io/tls Secret (tls.crt, tls.key): the engine pods' client "
                                   "certificate, for a Redis that demands one (tls-auth-clients).", {
            "name": string("Name of the Secret, in the InferenceService's namespace.", min_length=1),
        }, required=["name"]),
    })


def _internal_secret_ref() -> Schema:
    return secret_key_ref(
        "Secret key holding the deployment's internal secret (at least 32 characters; "
        "`tessera internal-secret` makes one): the bearer token engine pods demand of the gateway and of "
        "each other, the key of the MAC over shared KV values, the key of the tenants' cache salts. Absent: "
        "the operator creates the Secret NAME-internal with a random value once and never changes it "
        "(delete it, then restart the pods, to rotate).", default_key=SECRET_KEY)


def _internal_tls() -> Schema:
    return obj("Mutual TLS on the engine pods' gRPC port: the gateway and the engine pods present the same "
               "certificate and accept only peers signed by its CA (absent: plaintext inside the cluster, "
               "the bearer token still required). docs/operator.md has the cert-manager Certificate.", {
        "secretName": string("A kubernetes.io/tls Secret with tls.crt, tls.key and ca.crt (what cert-manager "
                             "writes), usable for server and client auth.", min_length=1),
        "serverName": string("A DNS name the certificate carries; the gateway checks the engines' certificate "
                             "against it (they are dialled by pod IP).", min_length=1, max_length=253),
    }, required=["secretName", "serverName"])


def _network_policy() -> Schema:
    return obj("NetworkPolicies: engine pods' gRPC port only from this InferenceService's gateway (and engine) "
               "pods, metrics ports only from the operator's namespace and `metricsNamespaces`, Redis (with "
               "kvStore.redis.podSelector) only from its engine pods. The gateway's public ports stay open. "
               "They take effect where the network plugin enforces NetworkPolicies.", {
        "enabled": boolean("Render the NetworkPolicies (false: none, pods accept any peer the network lets "
                           "through).", default=True),
        "metricsNamespaces": array("Namespaces besides the operator's whose pods may scrape the metrics ports "
                                   "(Prometheus's, say).",
                                   string("A namespace name.", pattern=NAMESPACE_PATTERN, max_length=63),
                                   default=[], max_items=16),
    }, default={})


def _gateway() -> Schema:
    priority_class = obj("A priority class of the gateway's admission.", {
        "name": string("Class name tenants and requests refer to.", min_length=1, max_length=63),
        "priority": integer("Engine priority; lower runs first (with engine.schedulingPolicy priority).",
                            minimum=0),
        "weight": integer("Share of dispatches in weighted fair queueing while requests wait.", minimum=1),
        "sheddable": boolean("Rejected first (429) when saturated.", default=False),
    }, required=["name", "priority", "weight"])
    default_classes = [{"name": "standard", "priority": 10, "weight": 4, "sheddable": False}]
    return obj("The gateway: the one entry point of clients.", {
        "replicas": integer("Gateway pods (they share no state).", default=1, minimum=1),
        "serviceType": string("Type of the gateway Service.", enum=["ClusterIP", "NodePort", "LoadBalancer"],
                              default="ClusterIP"),
        "tenantsSecretRef": obj("Secret with the tenants file (API-key hashes, limits) under the key "
                                "tenants.yaml; absent: open access, no API keys.", {
            "name": string("Name of the Secret, in the InferenceService's namespace.", min_length=1),
        }, required=["name"]),
        "priorityClasses": array("Admission classes, unique by name.", priority_class, default=default_classes,
                                 max_items=16, map_keys=["name"]),
        "defaultPriorityClass": string("Class of requests whose tenant and body name none.", default="standard"),
        "resources": _resources("CPU and memory of each gateway pod."),
    }, default={}, rules=[(DEFAULT_CLASS_RULE, "defaultPriorityClass must name one of priorityClasses")])


def _autoscaling() -> Schema:
    return obj("Autoscaling of the engine pools from their metrics.", {
        "enabled": boolean("Let the operator set the pools' replicas (false: each pool runs its `replicas`).",
                           default=True),
        "mixed": _scaling("mixed", ["queue", "ttft", "itl", "kvUsage"], "queue"),
        "prefill": _scaling("prefill", ["queue", "ttft"], "queue"),
        "decode": _scaling("decode", ["itl", "kvUsage"], "kvUsage"),
    }, default={})


def spec_schema() -> Schema:
    return obj("Desired state of an InferenceService.", {
        "model": _model(),
        "image": string("Container image of every component (gateway and engine pods).", default=DEFAULT_IMAGE,
                        min_length=1),
        "imagePullPolicy": string("Pull policy of that image.", enum=["Always", "IfNotPresent", "Never"],
                                  default="IfNotPresent"),
        "mode": string("mixed: one pool of mixed pods; disaggregated: a prefill and a decode pool.",
                       enum=["mixed", "disaggregated"], default="mixed"),
        "engine": _engine(),
        "pools": obj("Engine pools by role; mode picks which run (mixed, or prefill and decode), the others "
                     "are ignored.", {
            name: _pool() for name in POOL_NAMES
        }, default={}),
        "kvStore": _kv_store(),
        "gateway": _gateway(),
        "disaggregation": obj("When the gateway splits a request into prefill and decode (disaggregated mode).", {
            "minUncachedTokens": integer("Split prompts with at least this many tokens the best decode pod has not "
                                         "cached; shorter ones go to a decode pod alone.",
                                         default=256, minimum=0),
        }, default={}),
        "autoscaling": _autoscaling(),
        "internalSecretRef": _internal_secret_ref(),
        "internalTLS": _internal_tls(),
        "networkPolicy": _network_policy(),
    }, required=["model"], rules=[(TP_REDIS_RULE, "kvStore.redis does not support engine.tensorParallelSize "
                                                  "above 1 yet (KV blocks are not sharded per rank)")])


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
