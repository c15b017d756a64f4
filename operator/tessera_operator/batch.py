"""spec.batch rendered: the gateway config's `batch` section, the gateway pod's store volume or
Redis URL (an environment variable from the Secret, never in the ConfigMap or the command line)
and Redis TLS files, and the engine pods' background priority (the Batch API, docs/batch.md).

The class batch lines run at comes from the gateway's own rule (gateway/priority.py
`batch_priority_class`, imported: one home), so the engines' --background-priority is the
priority of the very class the gateway's runner submits lines at.
"""

from __future__ import annotations

from gateway.config import BATCH_REDIS_URL_ENV  # the gateway reads the batch Redis URL from it
from gateway.priority import PriorityClass, PriorityClasses, batch_priority_class
from tessera_operator import crd_batch, names, pod_parts, secret_files
from tessera_operator.names import Owner

# Where the gateway pod mounts spec.batch.volume (read-write; the root filesystem is read-only).
MOUNT = "/var/lib/tessera/batch"
VOLUME = "batch"


def key_prefix(owner: Owner, redis: dict) -> str:
    """spec.batch.redis.keyPrefix, else a prefix inside the InferenceService's KV key space
    (names.redis_key_prefix), so one Redis ACL pattern covers both."""
    return redis.get("keyPrefix") or f"{names.redis_key_prefix(owner)}batch:"


def directory(batch: dict) -> str:
    """Where the gateway keeps files and batches: the volume's path under the gateway pod's mount."""
    return pod_parts.folder_path(MOUNT, {"pvc": batch["volume"]})


def gateway_section(owner: Owner, spec: dict) -> dict | None:
    """The gateway config's `batch` (gateway/config.py BatchConfig), or None: the API is off.
    With redis, the URL is not here, a credential in a ConfigMap: the gateway reads it from its
    environment (`env`); the TLS files' paths are (secret_files.batch_redis_tls_config)."""
    batch = spec.get("batch")
    if batch is None:
        return None
    section: dict = {}
    if "volume" in batch:
        section["directory"] = directory(batch)
    else:
        section["key_prefix"] = key_prefix(owner, batch["redis"])
        section.update(secret_files.batch_redis_tls_config(spec))
    if "priorityClass" in batch:
        section["priority_class"] = batch["priorityClass"]
    for field, key, _ in crd_batch.LIMITS:
        section[key] = batch[field]
    return section


def uses_redis(spec: dict) -> bool:
    return "redis" in (spec.get("batch") or {})


def env(spec: dict) -> list[dict]:
    """The gateway container's BATCH_REDIS_URL_ENV from spec.batch.redis.urlSecretRef (none else)."""
    if not uses_redis(spec):
        return []
    ref = spec["batch"]["redis"]["urlSecretRef"]
    return [{"name": BATCH_REDIS_URL_ENV, "valueFrom": {"secretKeyRef": {"name": ref["name"], "key": ref["key"]}}}]


def volumes(spec: dict) -> tuple[list[dict], list[dict]]:
    """The gateway pod's volumes and the container's mounts: spec.batch.volume read-write, or
    spec.batch.redis.tls's Secrets read-only (none else)."""
    batch = spec.get("batch") or {}
    if "volume" not in batch:
        files = secret_files.batch_redis_tls(spec)
        return files.volumes, files.mounts
    return ([{"name": VOLUME, "persistentVolumeClaim": {"claimName": batch["volume"]["claimName"]}}],
            [{"name": VOLUME, "mountPath": MOUNT}])


def single_writer(spec: dict) -> bool:
    """Whether the gateway's store serves one process only (a directory): the Deployment then
    replaces its pod rather than rolling a second one in beside it."""
    return "volume" in (spec.get("batch") or {})


def _classes(spec: dict) -> PriorityClasses:
    gw = spec["gateway"]
    return PriorityClasses.from_config(gw["priorityClasses"], gw["defaultPriorityClass"])


def batch_class(spec: dict) -> PriorityClass:
    """The class the gateway's runner submits batch lines at (gateway/priority.py's rule)."""
    classes = _classes(spec)
    found = classes.get(batch_priority_class(classes, spec["batch"].get("priorityClass")))
    assert found is not None  # batch_priority_class names a defined class or raises
    return found


def background_priority(spec: dict) -> int | None:
    """The engines' --background-priority: engine.backgroundPriority; absent, with spec.batch and the
    priority policy, the batch class's priority when it runs after the default class (a larger
    priority: the default class, interactive traffic, must stay foreground); else None."""
    engine = spec["engine"]
    if "backgroundPriority" in engine:
        return int(engine["backgroundPriority"])
    if "batch" not in spec or engine["schedulingPolicy"] != "priority":
        return None
    priority = batch_class(spec).priority
    return priority if priority > _classes(spec).default.priority else None
