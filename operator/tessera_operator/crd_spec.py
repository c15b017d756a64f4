"""The InferenceService spec: its top level and the deployment-wide sections (model, images,
gateway, internal secret and TLS, NetworkPolicies); crd_engine has the engine pods' sections."""

from __future__ import annotations

from gateway.config import KV_CHANNELS, DisaggregationConfig
from gateway.tool_calls.parsers import parser_names
from tessera.internal_secret import SECRET_KEY
from tessera_operator import crd_batch
from tessera_operator.crd_engine import autoscaling_schema, engine_schema, kv_store_schema, pools_schema
from tessera_operator.crd_lora import LORA_NAMES_RULE, LORA_SETTINGS_RULE, loras_schema
from tessera_operator.schema_dsl import (
    DNS_LABEL_PATTERN,
    ONE_SOURCE_RULE,
    Schema,
    array,
    boolean,
    folder_sources,
    integer,
    number,
    obj,
    resources,
    secret_key_ref,
    size,
    string,
)

# The Dockerfile's two targets: `engine` (torch, the kernels' compiler) and the slim
# `control-plane` (gateway and operator, no torch).
DEFAULT_IMAGE = "ghcr.io/tessera-ai/tessera:0.1.0"
DEFAULT_CONTROL_PLANE_IMAGE = "ghcr.io/tessera-ai/tessera-control-plane:0.1.0"
DEFAULT_CLASS_RULE = "self.priorityClasses.exists(c, c.name == self.defaultPriorityClass)"
# An OTLP/gRPC endpoint is a URL with a scheme and no path (the SDK's exporter dials HOST:PORT).
TRACING_ENDPOINT_PATTERN = r"^https?://[^/\s]+/?$"  # no space, tab or newline in the host either
# In a CEL string literal the backslash is itself escaped.
TRACING_ENDPOINT_RULE = "self.endpoint.matches('{}')".format(TRACING_ENDPOINT_PATTERN.replace("\\", "\\\\"))
# disaggregation.kvChannel: the gateway's own default (Redis), unless asked; direct gives decode pods an inbox.
DEFAULT_KV_CHANNEL = DisaggregationConfig.kv_channel
DIRECT_KV_CHANNEL = "direct"
# disaggregation.inboxBytes: a budget (the inbox takes memory only as blocks arrive).
DEFAULT_INBOX_BYTES = "1Gi"


def spec_schema() -> Schema:
    return obj("Desired state of an InferenceService.", {
        "model": _model(),
        "loras": loras_schema(),
        "image": string("Container image of the engine pods (the Dockerfile's engine target, with torch); "
                        "the gateway's too when it is not this default and gateway.image is unset (the "
                        "engine image holds the gateway as well).", default=DEFAULT_IMAGE, min_length=1),
        "imagePullPolicy": string("Pull policy of the engine and gateway images.",
                                  enum=["Always", "IfNotPresent", "Never"], default="IfNotPresent"),
        "mode": string("mixed: one pool of mixed pods; disaggregated: a prefill and a decode pool.",
                       enum=["mixed", "disaggregated"], default="mixed"),
        "engine": engine_schema(),
        "pools": pools_schema(),
        "kvStore": kv_store_schema(),
        "gateway": _gateway(),
        "disaggregation": _disaggregation(),
        "batch": crd_batch.batch_schema(),
        "autoscaling": autoscaling_schema(),
        "internalSecretRef": _internal_secret_ref(),
        "internalTLS": _internal_tls(),
        "networkPolicy": _network_policy(),
        "tracing": _tracing(),
    }, required=["model"], rules=[
        (LORA_NAMES_RULE, "every loras[].name must differ from model.name (requests choose the adapter by it)"),
        (LORA_SETTINGS_RULE, "engine.lora needs adapters to serve: list them in loras, or folders to load them "
                             "from in engine.lora.runtimeRoots"),
        (crd_batch.CLASS_RULE, crd_batch.CLASS_MESSAGE),
        (crd_batch.VOLUME_REPLICAS_RULE, crd_batch.VOLUME_REPLICAS_MESSAGE),
    ])


def _model() -> Schema:
    return obj("The model to serve.", {
        "name": string("Served model name: the `model` field of requests, and what /v1/models lists.",
                       min_length=1, max_length=253,
                       pattern=r"^[A-Za-z0-9][A-Za-z0-9._/:-]*$"),
        **folder_sources(
            "Checkpoint on a PersistentVolumeClaim (ReadOnlyMany when pods span nodes).",
            "Checkpoint folder inside the volume, relative to its root (empty: the root).",
            "Checkpoint in a folder present on every node (single-node clusters; the local machine's folder for "
            "`tessera up`).",
            "Absolute path of the checkpoint folder (config.json, safetensors, tokenizer files)."),
        "dtype": string("Weights and activations dtype. auto: the checkpoint's on GPUs; on CPUs bfloat16 for a "
                        "bfloat16 checkpoint where the CPU has bf16 arithmetic, else float32.",
                        enum=["auto", "float32", "bfloat16", "float16"],
                        default="auto"),
        "maxModelLen": integer("Context length in tokens, prompt plus output (default: config.json's "
                               "max_position_embeddings).", minimum=1),
        "toolCallParser": string("How tool_choice \"auto\" finds tool calls in this model's text, by its family's "
                                 "format: hermes (<tool_call> JSON blocks: Hermes, Qwen2.5, Qwen3) or llama3_json "
                                 "(Llama 3.x's JSON calls). Absent: \"auto\" is refused; \"required\", a named "
                                 "function and \"none\" need no parser.", enum=list(parser_names())),
    }, required=["name"], rules=[(ONE_SOURCE_RULE, "set exactly one of model.pvc and model.hostPath")])


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
        "image": string("Container image of the gateway pods (absent: "
                        f"{DEFAULT_CONTROL_PLANE_IMAGE}, the Dockerfile's slim control-plane target, while "
                        "spec.image is the default; else spec.image).", min_length=1),
        "replicas": integer("Gateway pods (they share no state; 1 with batch.volume).", default=1, minimum=1),
        "serviceType": string("Type of the gateway Service.", enum=["ClusterIP", "NodePort", "LoadBalancer"],
                              default="ClusterIP"),
        "tenantsSecretRef": obj("Secret with the tenants file (API-key hashes, limits) under the key "
                                "tenants.yaml; absent: open access, no API keys.", {
            "name": string("Name of the Secret, in the InferenceService's namespace.", min_length=1),
        }, required=["name"]),
        "priorityClasses": array("Admission classes, unique by name.", priority_class, default=default_classes,
                                 max_items=16, map_keys=["name"]),
        "defaultPriorityClass": string("Class of requests whose tenant and body name none.", default="standard"),
        "resources": resources("CPU and memory of each gateway pod."),
    }, default={}, rules=[(DEFAULT_CLASS_RULE, "defaultPriorityClass must name one of priorityClasses")])


def _disaggregation() -> Schema:
    return obj("When the gateway splits a request into prefill and decode (disaggregated mode), and how the "
               "prompt's KV goes from the prefill pod to the decode pod.", {
        "minUncachedTokens": integer("Split prompts with at least this many tokens the best decode pod has not "
                                     "cached; shorter ones go to a decode pod alone.",
                                     default=256, minimum=0),
        "kvChannel": string("How a split prompt's KV reaches the decode pod. redis: the prefill pod writes it to "
                            "kvStore.redis, the decode pod reads it from there. direct: the prefill pod pushes "
                            "it (a ticket over gRPC with the internal token, then a raw TCP stream) into the "
                            "inbox (inboxBytes) of the decode pod the gateway picked, so decode pods must be "
                            "reachable from prefill pods on their gRPC and KV inbox ports (50061, 50063; the "
                            "operator's NetworkPolicy admits them); Redis stays the shared prefix tier and takes "
                            "the blocks of a push that fails.",
                            enum=list(KV_CHANNELS), default=DEFAULT_KV_CHANNEL),
        "inboxBytes": size("With kvChannel direct: the inbox of each decode pod (a pipeline-parallel group's "
                           "leader), in bytes (e.g. 2Gi), host memory where pushed blocks wait for their "
                           "request, least recently used dropped first. Size "
                           "it for the KV of a few prompts at once (Llama 3.1 8B in bfloat16: 128 KiB per token, "
                           "so 1Gi holds about 8,000 tokens): blocks dropped before their request reads them are "
                           "looked up in Redis, else recomputed. 0 turns the inbox off: every push is refused "
                           "and its blocks go through Redis.",
                           default=DEFAULT_INBOX_BYTES),
    }, default={})


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
        "serverName": string("A DNS name the certificate carries; the gateway (and a prefill pod pushing KV "
                             "to a decode pod) checks the engines' certificate against it (they are dialled by "
                             "pod IP).", min_length=1, max_length=253),
    }, required=["secretName", "serverName"])


def _network_policy() -> Schema:
    return obj("NetworkPolicies: engine pods' gRPC port only from this InferenceService's gateway (and engine) "
               "pods, metrics ports only from the operator's namespace and `metricsNamespaces`, Redis (with "
               "kvStore.redis.podSelector) only from its engine pods (and its gateway pods with batch.redis). "
               "The gateway's public ports stay open. "
               "They take effect where the network plugin enforces NetworkPolicies.", {
        "enabled": boolean("Render the NetworkPolicies (false: none, pods accept any peer the network lets "
                           "through).", default=True),
        "metricsNamespaces": array("Namespaces besides the operator's whose pods may scrape the metrics ports "
                                   "(Prometheus's, say).",
                                   string("A namespace name.", pattern=DNS_LABEL_PATTERN, max_length=63),
                                   default=[], max_items=16),
    }, default={})


def _tracing() -> Schema:
    return obj("OpenTelemetry traces of the gateway and the engine pods, exported over OTLP/gRPC (absent: no "
               "traces). The operator sets the standard OTEL_* variables on their containers; docs/gateway.md "
               "describes the spans.", {
        "endpoint": string("The collector's OTLP/gRPC endpoint, http://HOST:PORT (plaintext) or https://HOST:PORT "
                           "(TLS), e.g. http://otel-collector.observability:4317.", min_length=1, max_length=512),
        "samplingRatio": number("Share of traces recorded, 0 to 1, decided where a trace starts (a request "
                                "without a `traceparent`); a request with one, and every call inside a trace, "
                                "follows the decision already taken.",
                                default=1.0, minimum=0, maximum=1),
    }, required=["endpoint"], rules=[
        (TRACING_ENDPOINT_RULE, "tracing.endpoint must be an OTLP/gRPC URL: http://HOST:PORT or https://HOST:PORT "
                                "(no path)"),
    ])
