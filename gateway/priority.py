"""Priority classes: the engine priority, fair-share weight and sheddability
of a request, and the rules that pick a request's class."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from gateway.tenants import Tenant

_CLASS_FIELDS = ("name", "priority", "weight", "sheddable")


@dataclass(frozen=True)
class PriorityClass:
    name: str
    # Sent to the engine: lower runs first.
    priority: int
    # Share of gateway-queue dispatches while several classes wait.
    weight: float
    # Rejected at once (429) when the pool is saturated, instead of queueing.
    sheddable: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("priority class: name must be a non-empty string")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int) \
                or not -(2**31) <= self.priority < 2**31:  # the engine request's int32
            raise ValueError(f"priority class {self.name!r}: priority must be an integer in [-2**31, 2**31)")
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) \
                or not math.isfinite(self.weight) or self.weight <= 0:
            raise ValueError(f"priority class {self.name!r}: weight must be a finite number > 0")
        if not isinstance(self.sheddable, bool):
            raise ValueError(f"priority class {self.name!r}: sheddable must be true or false")


class PriorityClassError(ValueError):
    """The request names an unknown class or one its tenant may not use; client-safe."""


BUILTIN_CLASSES = (
    PriorityClass("critical", priority=0, weight=8.0),
    PriorityClass("standard", priority=10, weight=4.0),
    PriorityClass("batch", priority=20, weight=1.0, sheddable=True),
)
BUILTIN_DEFAULT = "standard"


class PriorityClasses:
    def __init__(self, classes: list[PriorityClass], default: str):
        if not classes:
            raise ValueError("priority classes: at least one class is required")
        self._by_name: dict[str, PriorityClass] = {}
        for pclass in classes:
            if pclass.name in self._by_name:
                raise ValueError(f"priority classes: duplicate name {pclass.name!r}")
            self._by_name[pclass.name] = pclass
        if default not in self._by_name:
            raise ValueError(f"default priority class {default!r} is not defined; defined: {self.names}")
        self._default = self._by_name[default]

    @classmethod
    def from_config(cls, items: list[Any] | None, default: str | None) -> PriorityClasses:
        """Items are mappings (or dataclasses) with name, priority, weight, sheddable.

        None gives the built-in set. Without a default, "standard" is used if
        defined, or the only class if there is one.
        """
        if items is None:
            return cls(list(BUILTIN_CLASSES), default or BUILTIN_DEFAULT)
        classes = [_class_from_item(item, i) for i, item in enumerate(items)]
        names = [c.name for c in classes]
        if default is None:
            if BUILTIN_DEFAULT in names:
                default = BUILTIN_DEFAULT
            elif len(names) == 1:
                default = names[0]
            else:
                raise ValueError(f"priority classes {names}: name the default class")
        return cls(classes, default)

    @property
    def default(self) -> PriorityClass:
        return self._default

    @property
    def names(self) -> list[str]:
        return list(self._by_name)

    def __iter__(self) -> Iterator[PriorityClass]:
        return iter(self._by_name.values())

    def __len__(self) -> int:
        return len(self._by_name)

    def get(self, name: str) -> PriorityClass | None:
        return self._by_name.get(name)

    def resolve(self, tenant: Tenant, requested: str | None) -> PriorityClass:
        """The request's class > the tenant's default > the global default."""
        # Empty string is "unset" too: proto3 strings cannot be None.
        name = requested or tenant.priority_class or self._default.name
        pclass = self._by_name.get(name)
        if pclass is None:
            raise PriorityClassError(f"unknown priority class {name!r}; available: {', '.join(self.names)}")
        allowed = tenant.allowed_priority_classes
        if allowed is not None and name not in allowed:
            raise PriorityClassError(
                f"priority class {name!r} is not allowed for this API key; allowed: {', '.join(sorted(allowed))}")
        return pclass

    def validate_tenants(self, tenants: Iterable[Tenant]) -> None:
        """Startup check: every class a tenant names exists, and a tenant that
        relies on the global default may use it. Raises ValueError."""
        for tenant in tenants:
            named = set(tenant.allowed_priority_classes or ())
            if tenant.priority_class is not None:
                named.add(tenant.priority_class)
            unknown = sorted(n for n in named if n not in self._by_name)
            if unknown:
                raise ValueError(f"tenant {tenant.name!r}: unknown priority class(es) {unknown}")
            allowed = tenant.allowed_priority_classes
            if tenant.priority_class is None and allowed is not None and self._default.name not in allowed:
                raise ValueError(f"tenant {tenant.name!r}: the default class {self._default.name!r} is not "
                                 "in its allowed_priority_classes; set its priority_class")


def _class_from_item(item: Any, index: int) -> PriorityClass:
    if dataclasses.is_dataclass(item) and not isinstance(item, type):
        item = dataclasses.asdict(item)
    if not isinstance(item, dict):
        raise ValueError(f"priority_classes[{index}]: expected a mapping")
    unknown = sorted(set(item) - set(_CLASS_FIELDS))
    if unknown:
        raise ValueError(f"priority_classes[{index}]: unknown field(s) {unknown}; known: {list(_CLASS_FIELDS)}")
    if "name" not in item or "priority" not in item:
        raise ValueError(f"priority_classes[{index}]: name and priority are required")
    return PriorityClass(item["name"], item["priority"], item.get("weight", 1.0), item.get("sheddable", False))


def batch_priority_class(classes: PriorityClasses, configured: str | None) -> str:
    """The class batch lines run at: the configured one, else the sheddable class
    that runs last (largest priority), else the class that runs last."""
    if configured is not None:
        if classes.get(configured) is None:
            raise ValueError(f"batch.priority_class: {configured!r} is not a priority class; "
                             f"defined: {classes.names}")
        return configured
    sheddable = [c for c in classes if c.sheddable]
    return max(sheddable or list(classes), key=lambda c: c.priority).name
