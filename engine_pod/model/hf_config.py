"""Parse a Hugging Face checkpoint's config.json into what the engine needs."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine_pod.model.rope_config import validate_rope_scaling
from tessera.context_length import max_position_embeddings, read_config, sliding_window

# Architectures the engine implements, and how each differs from Llama.
SUPPORTED_ARCHITECTURES: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    # Qwen2 always has q/k/v biases and no o_proj bias.
    "Qwen2ForCausalLM": {"qkv_bias": True, "o_bias": False},
}

if TYPE_CHECKING:
    import torch

# Every dtype name accepted, and the canonical name (a torch.dtype attribute) it means.
_DTYPES = {
    "float32": "float32",
    "float": "float32",
    "float16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "float64": "float64",
    "double": "float64",
}

# Bytes per element of each canonical dtype.
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def dtype_name(name: str | torch.dtype) -> str:
    """The canonical name of a dtype given by name (or as a torch.dtype); no torch needed."""
    try:
        return _DTYPES[str(name).removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(set(_DTYPES))} or 'auto', got {name!r}") from None


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    import torch  # here: reading a config needs no torch, only computing in a dtype does

    return getattr(torch, dtype_name(name))


@dataclass
class ModelArchConfig:
    """What the runner needs from a checkpoint's config.json, parsed once and checked."""

    architecture: str
    """The checkpoint's `architectures[0]` (LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM)."""
    vocab_size: int
    """Rows of the embedding and of the LM head."""
    hidden_size: int
    """Width of the residual stream."""
    num_hidden_layers: int
    """Decoder layers."""
    num_attention_heads: int
    """Query heads per layer."""
    num_key_value_heads: int
    """K/V heads per layer (fewer than query heads under grouped-query attention)."""
    head_dim: int
    """Width of one attention head (hidden_size / heads unless the checkpoint says otherwise)."""
    intermediate_size: int
    """Width of the MLP's gate/up projections."""
    rms_norm_eps: float
    """Epsilon of every RMSNorm."""
    rope_theta: float
    """Base of the rotary position embedding."""
    rope_scaling: dict[str, Any] | None
    """The checkpoint's RoPE scaling (llama3, linear, ...), or None."""
    max_position_embeddings: int
    """Positions the model was trained for (the context limit before the sliding-window cap)."""
    tie_word_embeddings: bool
    """Whether the LM head reuses the embedding matrix."""
    qkv_bias: bool
    """Whether the q/k/v projections carry a bias (Qwen2 does)."""
    o_bias: bool
    """Whether the attention output projection carries a bias."""
    mlp_bias: bool
    """Whether the MLP projections carry biases."""
    sliding_window: int | None
    """Tokens each position attends back to, when the checkpoint uses a sliding window; else None."""
    checkpoint_dtype: str | None
    """The dtype the weights are stored in (`torch_dtype`/`dtype`), when named: its canonical name."""
    bos_token_id: int | None
    """The beginning-of-sequence token, when the checkpoint names one."""
    eos_token_ids: list[int] = field(default_factory=list)
    """Every token that ends a sequence (config.json and generation_config.json together)."""
    raw: dict[str, Any] = field(default_factory=dict, repr=False)
    """The parsed config.json, for what the fields above do not carry."""


def _require(cfg: dict[str, Any], key: str, path: Path) -> Any:
    if key not in cfg:
        raise ValueError(f"{path}: config.json lacks the required field {key!r}")
    return cfg[key]


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    # Classic checkpoints carry rope_theta + rope_scaling; transformers v5
    # writes both into rope_parameters.
    params = cfg.get("rope_parameters")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        return theta, (None if rope_type == "default" else scaling)
    scaling = cfg.get("rope_scaling")
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return float(cfg.get("rope_theta", 10000.0)), scaling


def load_arch_config(model_path: str | Path) -> ModelArchConfig:
    path = Path(model_path)
    config_file = path / "config.json"
    cfg = read_config(path)
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ValueError(
            f"architectures: {archs!r} in {config_file} is not supported; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    overrides = SUPPORTED_ARCHITECTURES[arch]
    hidden = int(_require(cfg, "hidden_size", path))
    heads = int(_require(cfg, "num_attention_heads", path))
    rope_theta, rope_scaling = _rope(cfg)
    validate_rope_scaling(rope_scaling)
    attention_bias = bool(cfg.get("attention_bias", False))
    eos = cfg.get("eos_token_id")
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    stored_dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    return ModelArchConfig(
        architecture=arch,
        vocab_size=int(_require(cfg, "vocab_size", path)),
        hidden_size=hidden,
        num_hidden_layers=int(_require(cfg, "num_hidden_layers", path)),
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        intermediate_size=int(_require(cfg, "intermediate_size", path)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=max_position_embeddings(cfg),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=overrides.get("qkv_bias", attention_bias),
        o_bias=overrides.get("o_bias", attention_bias),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        sliding_window=sliding_window(cfg),
        checkpoint_dtype=dtype_name(stored_dtype) if stored_dtype else None,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        raw=cfg,
    )
