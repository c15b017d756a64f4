"""Reading pod objects: ready, starting, or on the way out."""

from __future__ import annotations


def is_terminating(pod: dict) -> bool:
    return bool(pod.get("metadata", {}).get("deletionTimestamp"))


def is_ready(pod: dict) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return not is_terminating(pod) and any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def is_starting(pod: dict) -> bool:
    """Capacity on the way: not ready yet, not terminating, not finished."""
    phase = (pod.get("status") or {}).get("phase", "Pending")
    return not is_terminating(pod) and not is_ready(pod) and phase in ("Pending", "Running")


def pod_ip(pod: dict) -> str | None:
    return (pod.get("status") or {}).get("podIP")


def pod_name(pod: dict) -> str:
    return pod["metadata"]["name"]
