"""The rope scalings a checkpoint's config.json may ask for, checked when
the config is read (no torch: a simulated pod reads configs too)."""

from __future__ import annotations

from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")


_REQUIRED_ROPE_FIELDS = {
    "default": (),
    "dynamic": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor",),
}


def rope_type_of(rope_scaling: dict[str, Any] | None) -> str:
    if rope_scaling is None:
        return "default"
    return rope_scaling.get("rope_type", rope_scaling.get("type", "default"))


def validate_rope_scaling(rope_scaling: dict[str, Any] | None) -> None:
    """Reject unsupported or malformed rope scaling when the config is read."""
    rope_type = rope_type_of(rope_scaling)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_scaling: rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    missing = [k for k in _REQUIRED_ROPE_FIELDS[rope_type] if not isinstance((rope_scaling or {}).get(k), (int, float))]
    if missing:
        raise ValueError(f"rope_scaling: {rope_type} rope needs numeric {missing}")
