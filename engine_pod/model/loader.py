"""Build a model and load its weights from a Hugging Face safetensors checkpoint.

Tensors are read lazily (safetensors slices): a module that holds a
tensor-parallel shard reads only its rows or columns, so no rank ever holds
the whole model, and peak extra memory is one shard of one tensor. Under
pipeline parallelism a stage's model has parameters for its own layers only,
so the other stages' tensors are skipped unread.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine_pod.attention.abstract import AttentionBackend
from engine_pod.distributed.parallel_state import PipelineGroup, TensorParallelGroup, single_rank_group
from engine_pod.model.hf_config import ModelArchConfig
from engine_pod.model.llama import STACKED_PARAMS, LlamaForCausalLM
from engine_pod.model.parallel_layers import pack_cpu_weights
from engine_pod.model.weight_source import WeightSource

# Checkpoint entries that are buffers, not weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(model_path: Path) -> list[Path]:
    index = model_path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_path / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {model_path}")
    return files


def iterate_checkpoint(model_path: Path) -> Iterator[WeightSource]:
    """Yield each tensor unread: its consumer reads what it holds."""
    for file in checkpoint_files(model_path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield WeightSource(name, f.get_slice(name))


def _checkpoint_names(model: nn.Module) -> set[str]:
    """The checkpoint tensor names the model needs (merged params expanded)."""
    names = set()
    for param_name, _ in model.named_parameters():
        module_path, _, leaf = param_name.rpartition(".")
        parent, _, merged = module_path.rpartition(".")
        if merged in STACKED_PARAMS:
            names.update(f"{parent}.{src}.{leaf}" for src, _ in STACKED_PARAMS[merged])
        else:
            names.add(param_name)
    return names


def _target(model: nn.Module, name: str) -> tuple[nn.Module, str, str | None] | None:
    """Map a checkpoint name to (module, parameter, shard) in our model."""
    module_path, _, leaf = name.rpartition(".")
    parent, _, proj = module_path.rpartition(".")
    for merged, sources in STACKED_PARAMS.items():
        for src, shard in sources:
            if proj == src:
                return model.get_submodule(f"{parent}.{merged}"), leaf, shard
    try:
        return model.get_submodule(module_path), leaf, None
    except AttributeError:
        return None


def load_weights(model: nn.Module, model_path: Path) -> None:
    expected = _checkpoint_names(model)
    loaded: set[str] = set()
    for source in iterate_checkpoint(model_path):
        name = source.name
        if name not in expected:
            continue  # tied lm_head copies, rotary buffers, extra heads
        module, leaf, shard = _target(model, name)
        if hasattr(module, "load_weight"):
            module.load_weight(leaf, shard, source)  # a parallel layer reads its own shard
        else:
            param = getattr(module, leaf)
            if tuple(param.shape) != source.shape:
                raise ValueError(f"weight {name}: checkpoint shape {source.shape} != model shape {tuple(param.shape)}")
            param.data.copy_(source.full())
        loaded.add(name)
    missing = expected - loaded
    if missing:
        shown = ", ".join(sorted(missing)[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise ValueError(f"model: checkpoint {model_path} is missing weight tensors: {shown}{more}")


def build_model(
    cfg: ModelArchConfig,
    model_path: Path,
    max_model_len: int,
    dtype: torch.dtype,
    device: torch.device,
    backend: AttentionBackend,
    group: TensorParallelGroup | None = None,
    pp: PipelineGroup | None = None,
) -> LlamaForCausalLM:
    group = group or single_rank_group(device)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg, max_model_len, dtype, backend, group, pp)
    finally:
        torch.set_default_dtype(previous)
    load_weights(model, model_path)
    model.eval()
    model.requires_grad_(False)
    if device.type == "cpu":
        pack_cpu_weights(model, own_kernels=backend.name == "cpu")
    return model
