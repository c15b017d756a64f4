"""The Batch API's section of the InferenceService spec: `spec.batch` (absent: the API is off).

It becomes the gateway config's `batch` section (gateway/config.py BatchConfig, docs/batch.md);
batch.py renders it. The limits' defaults are the gateway's own (BatchConfig), imported here so
the two cannot drift apart.
"""

from __future__ import annotations

from gateway.config import BATCH_REDIS_URL_ENV, BatchConfig
from tessera_operator.crd_engine import redis_tls_schema
from tessera_operator.schema_dsl import Schema, integer, obj, pvc_source, secret_key_ref, string

# Exactly one store: a directory on a volume (one gateway replica) or Redis (several).
ONE_STORE_RULE = "has(self.redis) != has(self.volume)"
# Rules on the spec: they read spec.batch and spec.gateway together.
CLASS_RULE = ("!has(self.batch) || !has(self.batch.priorityClass) || "
              "self.gateway.priorityClasses.exists(c, c.name == self.batch.priorityClass)")
VOLUME_REPLICAS_RULE = "!has(self.batch) || !has(self.batch.volume) || self.gateway.replicas == 1"
CLASS_MESSAGE = "batch.priorityClass must name one of gateway.priorityClasses"
VOLUME_REPLICAS_MESSAGE = ("batch.volume keeps files and batches in a directory that serves one gateway replica: "
                           "set gateway.replicas to 1, or use batch.redis, which several replicas share")
# What check_key_prefix (kv_store/redis_tier.py) lets through: no spaces, control or glob characters
# (a Redis ACL pattern is the prefix followed by *), at most 200 characters.
KEY_PREFIX_PATTERN = r"^[^\s\x00-\x1f\x7f*?\[\]\\]+$"
MAX_KEY_PREFIX_LENGTH = 200
# (spec field, BatchConfig field): the limits, each an integer >= 1 with the gateway's default.
LIMITS = (
    ("maxConcurrency", "max_concurrency",
     "Lines of batches each gateway replica has in flight at most, all batches together."),
    ("maxFileBytes", "max_file_bytes", "Bytes of one uploaded file at most (a larger upload is a 400)."),
    ("maxLinesPerFile", "max_lines_per_file", "Requests (lines) in one batch input file at most."),
    ("maxFilesPerTenant", "max_files_per_tenant", "Files one tenant (API key) keeps at most, uploads and batch "
                                                  "outputs together."),
    ("maxBatchesPerTenant", "max_batches_per_tenant", "Batches one tenant keeps at most, whatever their status."),
    ("retentionSeconds", "retention_s", "Seconds a finished batch and its output and error files are kept after it "
                                        "ended (30 days); then they are removed, which frees their quota places."),
)


def batch_schema() -> Schema:
    limits = {field: integer(description, default=getattr(BatchConfig, key), minimum=1)
              for field, key, description in LIMITS}
    return obj("The OpenAI Batch API (/v1/files, /v1/batches; docs/batch.md) on the gateway: files of requests "
               "run in the background at a low priority class, results kept in a store that survives restarts. "
               "Absent: the API is off (its routes answer 404). Set exactly one of redis and volume.", {
        "priorityClass": string("The gateway.priorityClasses class batch lines run at (absent: the sheddable class "
                                "with the largest priority, else the class with the largest priority). With "
                                "engine.schedulingPolicy priority and no engine.backgroundPriority, its priority "
                                "also becomes the engine pods' --background-priority when it is larger than "
                                "defaultPriorityClass's.", min_length=1, max_length=63),
        **limits,
        "redis": obj("Keep files and batches in Redis, which several gateway replicas share. It may be "
                     "kvStore.redis's Redis (the default keyPrefix lies in this InferenceService's KV key "
                     "space); kvStore.redis.podSelector's NetworkPolicy then admits the gateway pods too.", {
            "urlSecretRef": secret_key_ref("Secret key holding the redis:// or rediss:// URL (it may carry a "
                                           "password); the gateway pods get it as the environment variable "
                                           f"{BATCH_REDIS_URL_ENV}, never in their ConfigMap or on their "
                                           "command line.", default_key="url"),
            "tls": redis_tls_schema("gateway pods"),
            "keyPrefix": string("Prefix of every Redis key the Batch API writes (absent: "
                                "tessera:NAMESPACE/NAME:batch:, inside this InferenceService's KV key space, so "
                                "one Redis ACL `~tessera:NAMESPACE/NAME:*` covers both). No spaces or glob "
                                "characters.", min_length=1, max_length=MAX_KEY_PREFIX_LENGTH,
                                pattern=KEY_PREFIX_PATTERN),
        }, required=["urlSecretRef"]),
        "volume": pvc_source(
            "Keep files and batches in a directory on a PersistentVolumeClaim, mounted read-write into the gateway "
            "pod (ReadWriteOnce is enough; it must be writable by the pods' fsGroup 10001). One gateway replica "
            "only, and the gateway is replaced rather than rolled (a Recreate strategy), so two never share it.",
            "Directory inside the volume, relative to its root (empty: the root); created if missing."),
    }, rules=[(ONE_STORE_RULE, "set exactly one of batch.redis and batch.volume")])
