"""The weights of a GGUF file as Hugging Face tensors: named, dequantized, in HF's row order.

Names come from the `gguf` package's own table (TensorNameMap, the one llama.cpp's converter
writes with); values from its dequantizers (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the
K-quants and the others it implements). A tensor that no HF name claims, or an HF tensor the
file lacks, is an error: a file with more or fewer weights than its architecture is not a
model this import understands.
"""

from __future__ import annotations

from collections.abc import Iterator

import gguf
import numpy as np
import torch

from engine_pod.model.gguf.architectures import GGUFArchitecture
from engine_pod.model.gguf.gguf_file import GGUFFile

# GGUF tensors that carry nothing a HF checkpoint stores (llama.cpp's precomputed rope factors,
# which config.json's rope_scaling states).
_DERIVED = ("rope_freqs.weight",)

_LAYER_WEIGHTS = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm",
)


def hf_tensor_names(arch: GGUFArchitecture, num_layers: int, tied: bool) -> list[str]:
    """Every tensor a HF checkpoint of this shape holds."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not tied:
        names.append("lm_head.weight")
    for i in range(num_layers):
        names += [f"model.layers.{i}.{w}.weight" for w in _LAYER_WEIGHTS]
        if arch.qkv_bias:
            names += [f"model.layers.{i}.self_attn.{p}_proj.bias" for p in "qkv"]
    return names


def gguf_name_of(hf_name: str, names: gguf.TensorNameMap) -> str:
    found = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if found is None:
        raise ValueError(f"no GGUF tensor name for {hf_name}")  # a bug in this table, not in a file
    return found


def is_tied(file: GGUFFile) -> bool:
    """Whether the file reuses the embedding as the LM head (it has no `output.weight`)."""
    return "output.weight" not in file.tensors


def dequantize(file: GGUFFile, name: str) -> np.ndarray:
    """The tensor `name` as float32 in HF's shape (GGUF lists dimensions innermost first)."""
    tensor = file.tensors[name]
    shape = tuple(int(d) for d in reversed(tensor.shape))
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ValueError(f"{file.path}: tensor {name} has type {tensor.tensor_type.name}, which the gguf "
                         f"package cannot dequantize") from None
    values = np.asarray(values, dtype=np.float32).reshape(shape)
    # F32 comes back as a read-only view of the mapped file; torch wants its own copy.
    return values if values.flags.writeable else values.copy()


def _undo_rope_permutation(w: np.ndarray, heads: int) -> np.ndarray:
    # llama.cpp's converter reorders each head's rows from rotate-half pairs (i, i + d/2) to
    # interleaved pairs (2i, 2i + 1); this is its inverse.
    rest = w.shape[1:]
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(
    file: GGUFFile, arch: GGUFArchitecture, cfg: dict, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor in `dtype`) for every weight of the model, in a fixed order."""
    num_layers = cfg["num_hidden_layers"]
    names = gguf.get_tensor_name_map(arch.tensor_arch, num_layers)
    wanted = {hf: gguf_name_of(hf, names) for hf in hf_tensor_names(arch, num_layers, cfg["tie_word_embeddings"])}
    missing = sorted(g for g in wanted.values() if g not in file.tensors)
    if missing:
        raise ValueError(f"{file.path}: lacks the tensors {', '.join(missing[:6])}"
                         + (f" and {len(missing) - 6} more" if len(missing) > 6 else ""))
    extra = sorted(set(file.tensors) - set(wanted.values()) - set(_DERIVED))
    if extra:
        raise ValueError(f"{file.path}: has tensors a {file.architecture} model of this shape does not: "
                         f"{', '.join(extra[:6])}")
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    for hf_name, gguf_name in sorted(wanted.items()):
        values = dequantize(file, gguf_name)
        proj = hf_name.rsplit(".", 2)[-2]
        if arch.rope_permuted and proj in heads:
            values = _undo_rope_permutation(values, heads[proj])
        yield hf_name, torch.from_numpy(np.ascontiguousarray(values)).to(dtype)
