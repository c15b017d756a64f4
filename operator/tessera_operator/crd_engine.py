"""The engine pods' sections of the InferenceService spec: engine, pools, autoscaling, kvStore
(engine.lora is crd_lora's, beside spec.loras).

The engine's own choices are spelled out here (the operator does not import the engine, which
pulls in torch); tests/operator/test_reconcile.py checks they agree.
"""

from __future__ import annotations

from kv_store.block_hash import DEFAULT_BLOCK_SIZE
from tessera.roles import POD_ROLES
from tessera_operator.crd_lora import engine_lora_schema
from tessera_operator.schema_dsl import (
    Schema,
    array,
    boolean,
    integer,
    number,
    obj,
    quantity,
    resources,
    secret_key_ref,
    string,
    string_map,
)

# How a scale-down reads its window (autoscaling.<pool>.scaleDownStabilization).
DOWN_STABILIZATIONS = ("highest", "mean")

POOL_NAMES = POD_ROLES  # one pool per engine pod role
ATTENTION_BACKENDS = ("auto", "torch", "triton", "cpu")
SPEC_METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 32
MIN_LE_MAX_RULE = "self.minReplicas <= self.maxReplicas"
LOOKUP_BOUNDS_RULE = "self.promptLookupMin <= self.promptLookupMax"
DEFAULT_REDIS_PORT = 6379
# The engine's default of --background-max-batched-tokens (engine_pod/config.py SchedulerConfig).
DEFAULT_BACKGROUND_MAX_BATCHED_TOKENS = 256
# A request's priority is an int32 on the wire; the gateway's classes are >= 0.
MAX_PRIORITY = 2**31 - 1
BACKGROUND_POLICY_RULE = "!has(self.backgroundPriority) || self.schedulingPolicy == 'priority'"
# Pipeline stages per engine: one pod per stage (a LeaderWorkerSet group), each with the pool's TP GPUs.
MAX_PIPELINE_PARALLEL_SIZE = 64
# A LeaderWorkerSet's worker StatefulSets are named LWS-GROUP, and a StatefulSet's pods carry a
# label of its name plus an 11-character hash (63 at most): NAME-engine-GROUP (up to 4 digits)
# must stay within 52 characters, and so must NAME-decode-GROUP; NAME-prefill-GROUP is one longer.
MAX_PIPELINE_NAME_LENGTH = 40
MAX_PREFILL_PIPELINE_NAME_LENGTH = MAX_PIPELINE_NAME_LENGTH - 1


def uses_pipeline_cel(spec: str) -> str:
    """CEL: whether the spec (`spec`: its expression) sets any pipelineParallelSize above 1."""
    return " || ".join([f"{spec}.engine.pipelineParallelSize > 1"] + [
        f"(has({spec}.pools.{pool}.pipelineParallelSize) && {spec}.pools.{pool}.pipelineParallelSize > 1)"
        for pool in POD_ROLES])


def uses_pipeline(spec: dict) -> bool:
    """uses_pipeline_cel's Python twin, on a defaulted spec."""
    return max([spec["engine"]["pipelineParallelSize"]]
               + [pool.get("pipelineParallelSize", 1) for pool in spec["pools"].values()]) > 1


def prefill_group_cel(spec: str) -> str:
    """CEL: whether the spec's prefill pool runs (disaggregated mode) as a LeaderWorkerSet (its own
    pipelineParallelSize, else the engine's, above 1): the pool whose name is the longest."""
    size = (f"(has({spec}.pools.prefill.pipelineParallelSize) ? {spec}.pools.prefill.pipelineParallelSize : "
            f"{spec}.engine.pipelineParallelSize)")
    return f"({spec}.mode == 'disaggregated' && {size} > 1)"


def prefill_group(spec: dict) -> bool:
    """prefill_group_cel's Python twin, on a defaulted spec."""
    size = spec["pools"]["prefill"].get("pipelineParallelSize", spec["engine"]["pipelineParallelSize"])
    return spec["mode"] == "disaggregated" and size > 1


def engine_schema() -> Schema:
    return obj("Settings every engine pod shares.", {
        "tensorParallelSize": integer("GPUs one engine spans (tensor parallelism: one worker process per rank).",
                                      default=1, minimum=1, maximum=16),
        "pipelineParallelSize": integer(
            "Pipeline stages one engine spans (pipeline parallelism: the model's layers split across stages). "
            "Above 1 each engine replica is a LeaderWorkerSet group of this many pods, one stage each with "
            "tensorParallelSize GPUs; the leader (stage 0) runs the engine core: it serves gRPC and holds the "
            "KV store's tiers. Needs the LeaderWorkerSet controller in the cluster.",
            default=1, minimum=1, maximum=MAX_PIPELINE_PARALLEL_SIZE),
        "blockSize": integer("Tokens per KV block; the gateway hashes prompts in blocks of the same size.",
                             default=DEFAULT_BLOCK_SIZE, minimum=1, maximum=256),
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
        "backgroundPriority": integer(
            "Requests of this priority or above are background work (batch jobs): they run only on capacity the "
            "others leave idle, nothing in a step while another request waits or prefills (--background-priority; "
            "needs schedulingPolicy priority). Absent: with spec.batch, the batch class's priority when it is "
            "larger than gateway.defaultPriorityClass's (so the default class stays foreground), else none. Every "
            "class at or past it becomes background work.", minimum=0, maximum=MAX_PRIORITY),
        "backgroundMaxBatchedTokens": integer(
            "Tokens all background requests together take in one engine step at most: how much longer a step "
            "gets when an interactive request arrives behind them (--background-max-batched-tokens; absent: the "
            f"engine's {DEFAULT_BACKGROUND_MAX_BATCHED_TOKENS}).", minimum=1),
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
        "lora": engine_lora_schema(),
    }, default={}, rules=[(BACKGROUND_POLICY_RULE, "engine.backgroundPriority needs engine.schedulingPolicy "
                                                   "priority (under fcfs a background request at the head of the "
                                                   "queue would hold back the others)")])


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


def pools_schema() -> Schema:
    return obj("Engine pools by role; mode picks which run (mixed, or prefill and decode), the others "
               "are ignored.", {name: _pool() for name in POOL_NAMES}, default={})


def _pool() -> Schema:
    return obj("A pool of engine pods; its key is their role (mixed, prefill or decode).", {
        "replicas": integer("Pods of the pool without autoscaling; the starting count with it (under pipeline "
                            "parallelism: groups of pods).", default=1,
                            minimum=0),
        "minReplicas": integer("Lower bound of the autoscaler (0 allows scale to zero).", default=1, minimum=0),
        "maxReplicas": integer("Upper bound of the autoscaler.", default=4, minimum=1),
        "tensorParallelSize": integer("This pool's tensor parallelism (default: engine.tensorParallelSize). "
                                      "Prefill and decode pools may differ: KV blocks are stored whole, so "
                                      "any layout reads what any other wrote.", minimum=1, maximum=16),
        "pipelineParallelSize": integer("This pool's pipeline parallelism (default: engine.pipelineParallelSize): "
                                        "above 1, each replica is a group of this many pods.", minimum=1,
                                        maximum=MAX_PIPELINE_PARALLEL_SIZE),
        "gpus": integer("GPUs per pod (default: the pool's tensorParallelSize; 0 runs on CPU). Under pipeline "
                        "parallelism, per pod of a group (one stage).", minimum=0),
        "resources": resources("CPU and memory of each engine pod (GPUs come from `gpus`); memory must hold "
                               "the process plus kvStore.hostMemory. Under pipeline parallelism, the "
                               "groups' leaders get it as is and their workers less kvStore.hostMemory "
                               "(the leader alone holds the host tier)."),
        "nodeSelector": string_map("Node labels the pods must match."),
        "tolerations": _tolerations(),
    }, default={}, rules=[(MIN_LE_MAX_RULE, "minReplicas must not exceed maxReplicas")])


def _tolerations() -> Schema:
    return array("Tolerations of the pods.", obj("A toleration.", {
        "key": string("Taint key (empty with operator Exists matches every taint)."),
        "operator": string("Exists or Equal.", enum=["Exists", "Equal"]),
        "value": string("Taint value for operator Equal."),
        "effect": string("Effect to tolerate (empty: all).",
                         enum=["", "NoSchedule", "PreferNoSchedule", "NoExecute"]),
        "tolerationSeconds": integer("How long a NoExecute taint is tolerated (absent: forever).", minimum=0),
    }), max_items=32)


def autoscaling_schema() -> Schema:
    return obj("Autoscaling of the engine pools from their metrics.", {
        "enabled": boolean("Let the operator set the pools' replicas (false: each pool runs its `replicas`).",
                           default=True),
        # concurrency by default: the fleet benchmark's queue signal stayed near 0 while pods admitted
        # every request into their batch (4.2% of requests within the SLO; docs/benchmarks.md).
        "mixed": _scaling("mixed", ["queue", "ttft", "itl", "kvUsage", "concurrency"], "concurrency"),
        "prefill": _scaling("prefill", ["queue", "ttft", "concurrency"], "concurrency"),
        "decode": _scaling("decode", ["itl", "kvUsage", "concurrency"], "kvUsage"),
    }, default={})


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
    if "concurrency" in signals:
        targets["targetConcurrencyPerReplica"] = number(
            "concurrency: requests in flight (each pod's mean over the interval, plus those queued at the "
            "gateway) per ready pod, proportional to the load (Little's law). Set it to the batch one pod serves "
            "within its SLO, a share of engine.maxNumSeqs; the default 8 is a small batch (the fleet benchmark's "
            "decode batch per pod).", default=8, minimum=0.1)
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
        "scaleDownStabilization": string(
            "How a scale-down reads its window: highest (the Horizontal Pod Autoscaler's rule: only to the "
            "highest recommendation of the window) or mean (Knative's stable window: the window's mean demand, "
            "ready pods x observed/target each tick, rounded up; a noisy signal's single high ticks then do not "
            "hold the pool up for a whole window).", enum=list(DOWN_STABILIZATIONS), default="highest"),
    }, default={})


def kv_store_schema() -> Schema:
    return obj("Tiered KV store of the engine pods: KV blocks kept beyond the GPU's cache.", {
        "hostMemory": quantity("Host-memory KV tier of each engine pod (under pipeline parallelism, of each "
                               "group's leader, which runs the engine core), in bytes (e.g. 8Gi; 0 turns it off).",
                               default=0),
        "redis": obj("Redis tier shared by every engine pod of the model; disaggregated mode hands KV from "
                     "prefill to decode pods through it.", {
            "urlSecretRef": secret_key_ref("Secret key holding the redis:// or rediss:// URL (it may carry a "
                                           "password); the engine pods (of a pipeline-parallel group, the "
                                           "leader alone) get it as an environment variable, never on their "
                                           "command line.",
                                           default_key="url"),
            "tls": redis_tls_schema("engine pods"),
            "podSelector": string_map("Labels of the Redis pods (in this namespace): a NetworkPolicy then "
                                      "admits only this InferenceService's engine pods to them (of a "
                                      "pipeline-parallel pool, the groups' leaders), and its "
                                      "gateway pods too with batch.redis, on `port` (absent: no policy for "
                                      "Redis). The policy isolates those pods: replication or monitoring "
                                      "traffic to them needs a policy of its own."),
            "port": integer("Redis's port, for that NetworkPolicy.", default=DEFAULT_REDIS_PORT, minimum=1,
                            maximum=65535),
            "timeoutSeconds": number("Seconds each Redis call of an engine pod may take; a slower one is a miss "
                                     "(the blocks are recomputed), never a stall. Reads come in MGETs of about "
                                     "16 MiB; raise it for large models' P/D over a busy Redis.",
                                     default=0.25, minimum=0.01, maximum=600),
        }, required=["urlSecretRef"]),
    }, default={})


def redis_tls_schema(pods: str) -> Schema:
    """A Redis's TLS files (kvStore.redis.tls, batch.redis.tls: one shape), mounted into `pods`."""
    return obj(f"TLS files for a rediss:// URL, from Secrets mounted read-only into the {pods} (absent: "
               "the system's CAs, no client certificate). With cert-manager, both refs can name the one "
               "Certificate Secret (ca.crt, tls.crt, tls.key).", {
        "caSecretRef": secret_key_ref("Secret key holding the CA bundle that signs the Redis server's "
                                      "certificate.", default_key="ca.crt"),
        "clientCertSecretRef": obj(f"A kubernetes.io/tls Secret (tls.crt, tls.key): the {pods}' client "
                                   "certificate, for a Redis that demands one (tls-auth-clients).", {
            "name": string("Name of the Secret, in the InferenceService's namespace.", min_length=1),
        }, required=["name"]),
    })
