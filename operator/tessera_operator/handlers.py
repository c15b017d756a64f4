"""kopf handlers: apply the reconcile function, keep status, run the autoscaler.

The handlers are sync functions (kopf runs them in worker threads) and take
the cluster API from the operator's memo (`memo.api`), so tests hand them a
fake; `memo.operator_namespace` is where the operator runs (NetworkPolicies
let it scrape). Per-resource memory (scaler history, last metric samples)
lives in kopf's per-resource memo: an operator restart forgets it, which only
delays scale-down by one window (see autoscale.decide). The memo also holds a
lock, so the change handler and the timer of one resource take turns, and the
replicas of the last pass, which each pass starts from (status may lag).
"""

from __future__ import annotations

import datetime
import logging
import threading
import time

import kopf

from tessera_operator import crd, engine_pool, internal_secret, names
from tessera_operator.autoscale import Decision, ScalerState, ScalingPolicy, decide
from tessera_operator.cli import DEFAULT_INTERVAL_S
from tessera_operator.kube import ApiError, ClusterApi
from tessera_operator.names import Owner
from tessera_operator.observe import ScrapeMemory, gateway_demand, observe_pool
from tessera_operator.reconcile import desired_objects, pool_replicas, stale_keys, validated
from tessera_operator.status import build_status
from tessera_operator.validation import InvalidInferenceService

RESOURCE = (crd.GROUP, crd.VERSION, crd.PLURAL)


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def configure(settings: kopf.OperatorSettings, **_) -> None:
    """Keep kopf's bookkeeping in annotations (the status schema has no room for it)."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=crd.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=crd.GROUP)
    settings.persistence.finalizer = f"{crd.GROUP}/finalizer"
    # No CRD or namespace watching: the chart installs the CRD first, and namespaces are
    # named exactly, so the operator needs no cluster-wide read rights for discovery.
    settings.scanning.disabled = True
    settings.posting.level = logging.INFO


def _desired(body: dict, memo: kopf.Memo, replicas: dict[str, int]) -> list[dict]:
    return desired_objects(body, replicas, memo.get("operator_namespace"))


def _apply(api: ClusterApi, body: dict, objects: list[dict]) -> None:
    owner = Owner.of(body)
    # Before the pods that mount it; checked every pass, so a deleted one comes back.
    if internal_secret.ensure(api, owner, validated(body)["spec"]):
        kopf.info(body, reason="Created",
                  message=f"Secret {names.internal_secret_name(owner)} with a new internal secret")
    for obj in objects:
        api.apply(obj)
    for key in stale_keys(api.list_managed(owner.namespace, names.instance_selector(owner)), objects):
        api.delete(owner.namespace, key)
        kopf.info(body, reason="Deleted", message=f"{key.kind} {key.name} is no longer part of the spec")


def _write_status(api: ClusterApi, body: dict, patch: kopf.Patch, replicas: dict[str, int]) -> None:
    isvc = validated(body)
    owner = Owner.of(isvc)
    kinds = {names.gateway_name(owner): ("apps/v1", "Deployment")}
    kinds |= {names.pool_name(owner, r): engine_pool.workload_kind(isvc["spec"], r) for r in replicas}
    workloads = {name: api.get_workload(owner.namespace, *kind, name) for name, kind in kinds.items()}
    status = build_status(isvc, workloads, replicas, dict(body.get("status") or {}), now_iso())
    for key, value in status.items():
        patch.status[key] = value


def _invalid(body: dict, patch: kopf.Patch, error: InvalidInferenceService) -> kopf.PermanentError:
    kopf.warn(body, reason="InvalidSpec", message=str(error))
    patch.status["conditions"] = [{"type": "Ready", "status": "False", "reason": "InvalidSpec",
                                   "message": str(error), "lastTransitionTime": now_iso()}]
    return kopf.PermanentError(str(error))


def _pass(memo: kopf.Memo) -> threading.Lock:
    """One pass at a time per resource: kopf runs the change handler and the timer side by side
    (sync handlers, each in a thread of its own), and both apply the same objects and status."""
    return memo.setdefault("pass_lock", threading.Lock())


def _replicas(raw: dict, memo: kopf.Memo) -> dict[str, int]:
    """pool_replicas, with this process's last pass in place of status.pools: the body kopf hands a
    handler may predate the other handler's last status patch, and a change handler reading such
    a status would undo the scale-up the timer just made (which the next tick would make again)."""
    written = memo.get("replicas")
    if written:
        pools = {role: {"desiredReplicas": n} for role, n in written.items()}
        raw = {**raw, "status": {**(raw.get("status") or {}), "pools": pools}}
    return pool_replicas(raw)


def on_change(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, reason: str, logger: logging.Logger,
              **_) -> None:
    """create, update and resume: apply every desired object, prune stale ones, report status."""
    api: ClusterApi = memo.api
    raw = dict(body)
    with _pass(memo):
        try:
            replicas = _replicas(raw, memo)
            objects = _desired(raw, memo, replicas)
        except InvalidInferenceService as e:
            raise _invalid(raw, patch, e) from e
        try:
            _apply(api, raw, objects)
            _write_status(api, raw, patch, replicas)
        except ApiError as e:
            kopf.warn(raw, reason="ApplyFailed", message=str(e))
            raise kopf.TemporaryError(str(e), delay=10) from e
        memo["replicas"] = replicas
    logger.info("%s: applied %d objects", reason, len(objects))
    if reason != "resume":
        kopf.info(raw, reason="Applied", message=f"{len(objects)} objects applied ({reason})")


def on_delete(memo: kopf.Memo, logger: logging.Logger, name: str, **_) -> None:
    """Owner references let the garbage collector remove the children; only our memory goes here."""
    memo.pop("scalers", None)
    memo.pop("scrapes", None)
    memo.pop("replicas", None)
    logger.info("%s deleted; its objects go with it (owner references)", name)


def _autoscale(api: ClusterApi, body: dict, memo: kopf.Memo, replicas: dict[str, int],
               now: float) -> list[tuple[str, Decision]]:
    spec, owner = validated(body)["spec"], Owner.of(body)
    scalers: dict[str, ScalerState] = memo.setdefault("scalers", {})
    scrapes: ScrapeMemory = memo.setdefault("scrapes", ScrapeMemory())
    demand = gateway_demand(api, owner, scrapes)
    decisions = []
    for role, current in replicas.items():
        policy = ScalingPolicy.from_spec(spec, role)
        obs = observe_pool(api, owner, role, engine_pool.pod_selector(owner, spec, role), current, policy.signal,
                           demand, scrapes)
        decisions.append((role, decide(policy, obs, scalers.setdefault(role, ScalerState()), now)))
    return decisions


def on_tick(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, logger: logging.Logger, **_) -> None:
    """Every interval: autoscale each pool, re-apply (undoing hand edits), refresh status."""
    api: ClusterApi = memo.api
    raw = dict(body)
    with _pass(memo):
        try:
            replicas = _replicas(raw, memo)
        except InvalidInferenceService:
            return  # on_change has reported it; nothing safe to apply
        scaled = []
        try:
            if validated(raw)["spec"]["autoscaling"]["enabled"]:
                for role, decision in _autoscale(api, raw, memo, replicas, time.monotonic()):
                    if decision.changed:
                        replicas[role] = decision.replicas
                        scaled.append(role)
                        _report_scaling(raw, role, decision, logger)
            _apply(api, raw, _desired(raw, memo, replicas))
            _write_status(api, raw, patch, replicas)
            for role in scaled:
                patch.status["pools"][role]["lastScaleTime"] = now_iso()
        except ApiError as e:
            kopf.warn(raw, reason="ReconcileFailed", message=str(e))
            raise kopf.TemporaryError(str(e)) from e
        memo["replicas"] = replicas


def _report_scaling(body: dict, role: str, decision: Decision, logger: logging.Logger) -> None:
    message = f"{role} pool {decision.previous} -> {decision.replicas}: {decision.message}"
    logger.info(message)
    kopf.info(body, reason=decision.reason, message=message)


def register(registry: kopf.OperatorRegistry, interval: float = DEFAULT_INTERVAL_S) -> None:
    kopf.on.startup(registry=registry)(configure)
    kopf.on.create(*RESOURCE, registry=registry)(on_change)
    kopf.on.update(*RESOURCE, registry=registry)(on_change)
    kopf.on.resume(*RESOURCE, registry=registry)(on_change)
    # optional: no finalizer, so deleting a resource never waits for the operator.
    kopf.on.delete(*RESOURCE, registry=registry, optional=True)(on_delete)
    kopf.timer(*RESOURCE, registry=registry, interval=interval)(on_tick)
