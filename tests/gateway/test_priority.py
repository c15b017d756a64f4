"""Priority classes: configuration and the rules that pick a request's class."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from gateway.priority import PriorityClass, PriorityClassError, PriorityClasses
from gateway.tenants import RateLimits, Tenant


def _tenant(priority_class=None, allowed=None) -> Tenant:
    return Tenant("acme", priority_class, frozenset(allowed) if allowed else None, RateLimits(), "tenant:acme")


def test_builtin_classes():
    classes = PriorityClasses.from_config(None, None)
    assert [(c.name, c.priority, c.weight, c.sheddable) for c in classes] == [
        ("critical", 0, 8.0, False), ("standard", 10, 4.0, False), ("batch", 20, 1.0, True)]
    assert classes.default.name == "standard"
    assert classes.get("batch").sheddable and classes.get("nope") is None
    assert len(classes) == 3


def test_from_config_mappings_and_dataclasses():
    @dataclass(frozen=True)
    class Item:  # the shape of gateway.config.PriorityClassConfig
        name: str
        priority: int
        weight: float = 1.0
        sheddable: bool = False

    classes = PriorityClasses.from_config(
        [{"name": "gold", "priority": 1, "weight": 3}, Item("bronze", 5, sheddable=True)], "gold")
    assert classes.get("gold") == PriorityClass("gold", 1, 3)
    assert classes.get("bronze") == PriorityClass("bronze", 5, 1.0, True)
    # Without a default: "standard" if defined, else the only class.
    assert PriorityClasses.from_config([{"name": "only", "priority": 0}], None).default.name == "only"
    two = [{"name": "standard", "priority": 1}, {"name": "low", "priority": 2}]
    assert PriorityClasses.from_config(two, None).default.name == "standard"


@pytest.mark.parametrize("items, default, fragment", [
    ([{"name": "a", "priority": 0}, {"name": "a", "priority": 1}], "a", "duplicate"),
    ([{"name": "a", "priority": 0}], "b", "not defined"),
    ([{"name": "a", "priority": 0, "weight": 0}], "a", "weight"),
    ([{"name": "a", "priority": 0, "weight": -1}], "a", "weight"),
    ([{"name": "a", "priority": 0, "wieght": 2}], "a", "unknown field"),
    ([{"name": "a"}], "a", "required"),
    ([{"name": "a", "priority": "high"}], "a", "integer"),
    ([{"name": "a", "priority": 2**31}], "a", "integer in"),  # would overflow every engine request
    ([{"name": "a", "priority": 0}, {"name": "b", "priority": 1}], None, "name the default"),
    ([], "a", "at least one"),
])
def test_bad_config_is_rejected(items, default, fragment):
    with pytest.raises(ValueError, match=fragment):
        PriorityClasses.from_config(items, default)


def test_resolve_precedence_request_then_tenant_then_default():
    classes = PriorityClasses.from_config(None, None)
    assert classes.resolve(_tenant(), None).name == "standard"
    assert classes.resolve(_tenant(), "").name == "standard"  # proto3's unset string
    assert classes.resolve(_tenant("batch"), None).name == "batch"
    assert classes.resolve(_tenant("batch"), "critical").name == "critical"


def test_resolve_rejects_unknown_and_disallowed_classes():
    classes = PriorityClasses.from_config(None, None)
    with pytest.raises(PriorityClassError, match="unknown priority class 'urgent'"):
        classes.resolve(_tenant(), "urgent")
    limited = _tenant("batch", allowed={"batch", "standard"})
    assert classes.resolve(limited, "standard").name == "standard"
    with pytest.raises(PriorityClassError, match="'critical' is not allowed"):
        classes.resolve(limited, "critical")


def test_validate_tenants_catches_bad_references():
    classes = PriorityClasses.from_config(None, None)
    classes.validate_tenants([_tenant(), _tenant("batch", {"batch"})])
    with pytest.raises(ValueError, match="unknown priority class"):
        classes.validate_tenants([_tenant("gold")])
    with pytest.raises(ValueError, match="unknown priority class"):
        classes.validate_tenants([_tenant(None, {"batch", "gold"})])
    # Relies on the default "standard" but may only use batch.
    with pytest.raises(ValueError, match="default class"):
        classes.validate_tenants([_tenant(None, {"batch"})])
