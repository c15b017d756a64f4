"""The GGUF architectures the engine runs, and the Hugging Face config each becomes.

GGUF names a model's shape under `{arch}.*` keys; config.json names the same numbers as
transformers does. llama.cpp writes Mistral checkpoints as `llama`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np

from engine_pod.model.gguf.gguf_file import GGUFFile


@dataclass(frozen=True)
class GGUFArchitecture:
    hf_architecture: str
    """config.json's `architectures[0]`."""
    model_type: str
    """config.json's `model_type`."""
    tensor_arch: gguf.MODEL_ARCH
    """The `gguf` package's name for the layout of this family's tensors."""
    rope_permuted: bool
    """Whether llama.cpp's converter reordered the rows of q and k for its interleaved rotary
    embedding (Llama does; Qwen2 keeps the rotate-half order), to be undone on import."""
    qkv_bias: bool = False
    """Whether the q/k/v projections carry biases."""


ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture("LlamaForCausalLM", "llama", gguf.MODEL_ARCH.LLAMA, rope_permuted=True),
    "qwen2": GGUFArchitecture("Qwen2ForCausalLM", "qwen2", gguf.MODEL_ARCH.QWEN2, rope_permuted=False, qkv_bias=True),
}

# Keys whose presence means a shape the engine does not run, though the family is supported.
_UNSUPPORTED_KEYS = {"expert_count": "mixture-of-experts layers"}


def architecture_of(file: GGUFFile) -> GGUFArchitecture:
    name = file.architecture
    if name not in ARCHITECTURES:
        raise ValueError(f"{file.path}: architecture {name!r} is not one the engine runs; "
                         f"supported: {sorted(ARCHITECTURES)}")
    for key, what in _UNSUPPORTED_KEYS.items():
        if (file.get(f"{name}.{key}") or 0) > 0:
            raise ValueError(f"{file.path}: {name}.{key} is set: the engine does not run {what}")
    return ARCHITECTURES[name]


def _rope_scaling(file: GGUFFile, arch: str) -> dict[str, Any] | None:
    kind = file.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = file.get(f"{arch}.rope.scaling.factor")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        original = file.get(f"{arch}.rope.scaling.original_context_length")
        return {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original)}
    raise ValueError(f"{file.path}: {arch}.rope.scaling.type {kind!r} is not supported (linear, yarn)")


def _shortest(value: float) -> float:
    # GGUF stores these as float32: 1e-5 reads back as 9.999999747e-06. The shortest decimal
    # that rounds to the same float32 is what the original config.json said.
    return float(str(np.float32(value)))


def hf_config(file: GGUFFile, vocab_size: int, tied: bool, dtype: str,
              special_ids: dict[str, int | None]) -> dict[str, Any]:
    """config.json for the model in `file`: `vocab_size` rows, the LM head tied to the embedding
    when `tied`, weights stored in `dtype`."""
    arch_name = file.architecture
    arch = architecture_of(file)

    def key(name: str) -> Any:
        return file.require(f"{arch_name}.{name}")

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    kv_heads = int(file.get(f"{arch_name}.attention.head_count_kv") or heads)
    head_dim = int(file.get(f"{arch_name}.attention.key_length") or file.get(f"{arch_name}.rope.dimension_count")
                   or hidden // heads)
    cfg: dict[str, Any] = {
        "architectures": [arch.hf_architecture],
        "model_type": arch.model_type,
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(key("context_length")),
        "rms_norm_eps": _shortest(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": _shortest(file.get(f"{arch_name}.rope.freq_base") or 10000.0),
        "rope_scaling": _rope_scaling(file, arch_name),
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "torch_dtype": dtype,
        "use_cache": True,
        **{f"{name}_token_id": value for name, value in special_ids.items()},
    }
    if arch.model_type == "qwen2":
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg["num_hidden_layers"])
    return cfg
