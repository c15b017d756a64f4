"""A checkpoint's context length, read from its config.json: one home for
the engine (engine_pod/config.py, engine_pod/model/hf_config.py) and the
gateway (gateway/model.py), so the gateway never admits a prompt the
engine pods cannot hold. No torch: the control plane calls it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# What the engine assumes when config.json names no max_position_embeddings.
DEFAULT_MAX_POSITION_EMBEDDINGS = 2048


def read_config(model_path: str | Path) -> dict[str, Any]:
    """The checkpoint's config.json; ValueError when the folder has none."""
    path = Path(model_path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(f"model: {path} is not a Hugging Face checkpoint folder (no config.json)")
    return json.loads(config_file.read_text())


def max_position_embeddings(config: dict[str, Any]) -> int:
    return int(config.get("max_position_embeddings", DEFAULT_MAX_POSITION_EMBEDDINGS))


def sliding_window(config: dict[str, Any]) -> int | None:
    """The attention window, None for full attention. Qwen2 checkpoints carry
    a sliding_window they use only with use_sliding_window."""
    window = config.get("sliding_window")
    if "Qwen2ForCausalLM" in (config.get("architectures") or []) and not config.get("use_sliding_window", False):
        window = None
    return int(window) if window else None


def context_limit(config: dict[str, Any]) -> int:
    """The longest sequence the engine serves: the positions the model has,
    capped at its sliding window (beyond it the model attends differently,
    and the engine serves only what full attention computes exactly)."""
    limit = max_position_embeddings(config)
    window = sliding_window(config)
    return min(limit, window) if window is not None else limit


def resolve_max_model_len(requested: int | None, config: dict[str, Any]) -> int:
    """The context length to serve: `requested`, or the model's limit when
    None; ValueError naming max_model_len when it is not a positive integer
    or exceeds the limit."""
    limit = context_limit(config)
    if limit < max_position_embeddings(config):
        logger.warning("sliding_window=%d: capping max_model_len at the window", limit)
    if requested is None:
        return limit
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise ValueError(f"max_model_len must be a positive integer, got {requested!r}")
    if requested > limit:
        raise ValueError(
            f"max_model_len ({requested}) exceeds what the model supports ({limit}: "
            "max_position_embeddings or sliding_window in config.json)"
        )
    return requested
