"""spec.batch rendered: the gateway config's `batch` section, the gateway pod's store volume, and
the engine pods' background priority (the Batch API, docs/batch.md).

The class batch lines run at comes from the gateway's own rule (gateway/batch/runner.py
`batch_priority_class`, imported: one home), so the engines' --background-priority is the
priority of the very class the gateway's runner submits lines at.
"""

from __future__ import annotations

from gateway.batch.runner import batch_priority_class
from gateway.priority import PriorityClass, PriorityClasses
from tessera_operator import crd_batch, names, pod_parts
from tessera_operator.names import Owner
from tessera_operator.validation import FieldError

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
    With redis, the URL is not here: it is a credential (see cluster_problems)."""
    batch = spec.get("batch")
    if batch is None:
        return None
    section: dict = {}
    if "volume" in batch:
        section["directory"] = directory(batch)
    else:
        section["key_prefix"] = key_prefix(owner, batch["redis"])
    if "priorityClass" in batch:
        section["priority_class"] = batch["priorityClass"]
    for field, key, _ in crd_batch.LIMITS:
        section[key] = batch[field]
    return section


def cluster_problems(spec: dict) -> list[FieldError]:
    """What the schema takes but a cluster cannot run yet (`tessera up` can)."""
    if "redis" in (spec.get("batch") or {}):
        return [FieldError("spec.batch.redis", "not served in a cluster yet: the gateway reads batch.redis_url "
                                               "only from its config file, and the operator never puts a "
                                               "credential into a ConfigMap; use batch.volume (one gateway "
                                               "replica)")]
    return []


def volumes(spec: dict) -> tuple[list[dict], list[dict]]:
    """The gateway pod's volume and the container's read-write mount of spec.batch.volume (none else)."""
    batch = spec.get("batch") or {}
    if "volume" not in batch:
        return [], []
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
    """The class the gateway's runner submits batch lines at (gateway/batch/runner.py's rule)."""
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
