"""The models the gateway serves: the base model and its LoRA adapters.

Clients name one in the OpenAI `model` field. Adapters are known from three
sources (docs/gateway.md, LoRA adapters):

- the config's `model.loras` (the operator renders them from the
  InferenceService's `spec.loras`, and the pods' `--lora-modules` alike);
- the engine pods' load reports (`LoadReport.lora_adapters`): an adapter
  another gateway replica loaded at run time, or one a pod was started with;
- this gateway's admin endpoints (gateway/lora_admin.py): a load adds the
  name and an unload removes it at once, before the pods' next reports.

A tenant's `allowed_models` narrows what it may use and see: a model outside
it gets the same 404 as a name nobody serves, so a tenant cannot probe which
adapters exist (`resolve`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from gateway.errors import model_not_found
from gateway.pods import Pod, PodPool
from gateway.tenants import Tenant

# The metric label of a request whose `model` names nothing served: client
# input never becomes a label value. Parentheses are outside the adapter
# name rule (gateway/config.py), so no adapter can take this label.
UNKNOWN_MODEL_LABEL = "(unknown)"


@dataclass(frozen=True)
class ModelEntry:
    """One model of `GET /v1/models`."""

    id: str
    """The name clients send as `model`."""
    parent: str | None
    """The base model's name for an adapter; None for the base model itself."""


def serves(pod: Pod, lora_name: str) -> bool:
    """Whether the pod's last report (or admin answer) lists the adapter."""
    return lora_name in pod.adapters


def resident(pod: Pod, lora_name: str) -> bool:
    """Whether the pod holds the adapter's weights in its host memory."""
    adapter = pod.adapters.get(lora_name)
    return adapter is not None and adapter.resident


class ModelCatalog:
    def __init__(self, base: str, loras: Iterable[str], pool: PodPool) -> None:
        self.base = base
        self.pool = pool
        # The config's adapters, plus this gateway's admin loads, less its unloads.
        self._names: set[str] = set(loras)

    # -- what exists -------------------------------------------------------
    def adapter_names(self) -> list[str]:
        """Every adapter known, sorted: the gateway's own list and every pod's report."""
        names = set(self._names)
        for pod in self.pool.pods.values():
            names.update(pod.adapters)
        names.discard(self.base)
        return sorted(names)

    def is_adapter(self, name: str) -> bool:
        if name == self.base:
            return False
        return name in self._names or any(serves(p, name) for p in self.pool.pods.values())

    def known(self, name: str) -> bool:
        return name == self.base or self.is_adapter(name)

    # -- per request -------------------------------------------------------
    def resolve(self, model: str, tenant: Tenant) -> str:
        """The engine's `lora_name` for the request's `model` ("" for the base
        model); model_not_found when nothing of that name is served or the
        tenant may not use it (one answer for both)."""
        if not tenant.may_use(model) or not self.known(model):
            raise model_not_found(model)
        return "" if model == self.base else model

    def visible(self, tenant: Tenant) -> list[ModelEntry]:
        """The models `tenant` may use: the base model first, then the adapters by name."""
        entries = [ModelEntry(self.base, None)] + [ModelEntry(n, self.base) for n in self.adapter_names()]
        return [e for e in entries if tenant.may_use(e.id)]

    def find(self, model: str, tenant: Tenant) -> ModelEntry:
        """`GET /v1/models/{model}`: its entry, or model_not_found as `resolve` answers."""
        lora_name = self.resolve(model, tenant)
        return ModelEntry(model, self.base if lora_name else None)

    def fingerprint(self, lora_name: str) -> str | None:
        """The adapter's identity in block hashes, as the pods serving it report
        it (kv_store.block_hash, `adapter=`); None when no pod reports it. Pods
        disagreeing (one name, other files: a misconfiguration) cost prefix
        hits on the minority, never wrong KV, since each pod hashes with its
        own: the most reported one wins, ties to the smallest, so every
        replica picks the same."""
        counts = Counter(a.fingerprint for p in self.pool.pods.values()
                         if (a := p.adapters.get(lora_name)) is not None and a.fingerprint)
        if not counts:
            return None
        return min(counts, key=lambda f: (-counts[f], f))

    def metric_label(self, model: str) -> str:
        """The `model` label of a request: a served model's name, else UNKNOWN_MODEL_LABEL."""
        return model if self.known(model) else UNKNOWN_MODEL_LABEL

    # -- admin -------------------------------------------------------------
    def added(self, lora_name: str) -> None:
        """An admin load succeeded on some pod: routed from the next request on."""
        self._names.add(lora_name)

    def removed(self, lora_name: str) -> None:
        """An admin unload: no longer this gateway's own; it stays known only
        while some pod still reports serving it."""
        self._names.discard(lora_name)
