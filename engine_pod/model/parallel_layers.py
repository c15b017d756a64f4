"""Tensor-parallel layers (Megatron-style), each loading only its own shard.

- Column-parallel (QKV, gate/up): every rank holds a slice of the output
  rows and computes its slice of the output; no communication.
- Row-parallel (O, down): every rank holds a slice of the input columns, so
  its product is a partial sum; one all-reduce per layer completes it.
- Vocab-parallel embedding and LM head: each rank holds a contiguous range
  of the vocabulary (padded to equal ranges so shapes match across ranks).

At one rank the shapes equal the unsharded model's and every collective is a
no-op, so TP=1 runs exactly the arithmetic it always did.

On a CPU the projection weights are repacked once loaded into oneDNN's
blocked layout (``pack_weight``): its GEMMs then read the weights in the
order they compute, which on the bench model's shapes took 1.2-1.8x less
time than the unpacked GEMM (decode batches the most: `tessera bench
cpu-kernels`). float32 weights on an AVX2 machine without AVX-512 go to the
cpu backend's own GEMM instead (cpu_ops/linear_f32.cpp), which there runs
the few-row products of decode steps 1.1-1.5x faster than oneDNN's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine_pod.distributed.parallel_state import TensorParallelGroup
from engine_pod.lora.layers import LinearLoRA
from engine_pod.model.weight_source import WeightSource


class PackableLinear(nn.Module):
    """A layer whose forward multiplies by ``weight`` (and adds ``bias``),
    with the weight either dense or, on a CPU, packed for oneDNN or for the
    cpu backend's float32 GEMM."""

    weight: nn.Parameter
    bias: nn.Parameter | None
    packed: str | None = None  # None (dense), "onednn" or "tessera"
    out_features = 0  # the dense weight's rows (a "tessera" weight holds them in padded panels)
    # Adapter slots (engine_pod/lora/layers.attach_lora), on the projections of an engine with LoRA.
    # Set per instance, not here: nn.Module finds a submodule only where no class attribute shadows it.
    lora: LinearLoRA | None

    def __init__(self) -> None:
        super().__init__()
        self.lora = None

    def pack_weight(self, own_kernels: bool = False) -> bool:
        """Replace the dense weight by a packed copy that only ``matmul``
        reads: for the cpu backend's float32 GEMM where ``own_kernels`` (its
        ops are loaded) and it runs here, else for oneDNN (same shape and
        values). False where neither can take this dtype on this CPU: the
        layer stays dense."""
        dense = self.weight.detach()
        if own_kernels and dense.dtype == torch.float32 and torch.ops.tessera_cpu.linear_f32_supported():
            packed, kind = torch.ops.tessera_cpu.pack_linear_f32(dense), "tessera"
        else:
            try:
                packed, kind = torch.ops.mkldnn._reorder_linear_weight(dense, None), "onednn"
            except RuntimeError:
                return False
        self.out_features = dense.shape[0]
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.packed = kind
        return True

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.packed == "tessera":
            return torch.ops.tessera_cpu.linear_f32(x, self.weight, self.out_features, bias)
        if self.packed == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, bias, "none", [None], "")
        return nn.functional.linear(x, self.weight, bias)


def pack_cpu_weights(model: nn.Module, own_kernels: bool = False) -> int:
    """Pack every projection of a CPU model (not embeddings: they are looked
    up by row); ``own_kernels``: the cpu backend's ops are loaded, so its
    float32 GEMM may take them. Returns how many layers were packed."""
    if not torch.backends.mkldnn.is_available() and not own_kernels:
        return 0
    layers = [m for m in model.modules() if _is_packable(m) and m.weight.device.type == "cpu"]
    return sum(layer.pack_weight(own_kernels) for layer in layers)


@dataclass(frozen=True)
class OutputShard:
    """One checkpoint projection's rows held by this rank inside a merged weight."""

    name: str  # "q", "k", "v", "gate", "up"
    local_offset: int  # first row in the merged local weight
    size: int  # rows this rank holds
    source_start: int  # first row in the checkpoint tensor


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """KV heads split across ranks; with fewer KV heads than ranks each rank
    keeps one replica (of the head its query heads attend to)."""
    return max(1, num_kv_heads // tp_size)


def kv_head_range(num_kv_heads: int, tp_size: int, rank: int) -> range:
    """The model's KV heads that ``rank`` holds (its share of the KV cache).
    Rank r's query heads start at r * q_heads and share the KV head
    (r * q_heads) // (num_heads // num_kv_heads) = (r * num_kv_heads) // tp,
    which covers both the split and the replicated case (where ranges of
    neighbouring ranks are the same head)."""
    start = (rank * num_kv_heads) // tp_size
    return range(start, start + kv_heads_per_rank(num_kv_heads, tp_size))


def qkv_shards(num_heads: int, num_kv_heads: int, head_dim: int, group: TensorParallelGroup) -> list[OutputShard]:
    tp, rank = group.world_size, group.rank
    q_heads = num_heads // tp
    kv_heads = kv_head_range(num_kv_heads, tp, rank)
    q, kv = q_heads * head_dim, len(kv_heads) * head_dim
    return [
        OutputShard("q", 0, q, rank * q),
        OutputShard("k", q, kv, kv_heads.start * head_dim),
        OutputShard("v", q + kv, kv, kv_heads.start * head_dim),
    ]


def split_shards(names: list[str], full_size: int, group: TensorParallelGroup) -> list[OutputShard]:
    """Equal splits of same-sized projections (gate and up)."""
    local = full_size // group.world_size
    return [OutputShard(n, i * local, local, group.rank * local) for i, n in enumerate(names)]


class MergedColumnParallelLinear(PackableLinear):
    """Several checkpoint projections stacked into one GEMM (q/k/v, or
    gate/up), each holding only this rank's rows of its projection."""

    def __init__(self, in_features: int, shards: list[OutputShard], bias: bool) -> None:
        super().__init__()
        self.shards = {s.name: s for s in shards}
        out_features = sum(s.size for s in shards)
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x, self.bias)
        if self.lora is not None:
            self.lora.apply(x, out)
        return out

    def load_weight(self, param_name: str, shard_name: str | None, source: WeightSource) -> None:
        shard = self.shards[shard_name]
        target = getattr(self, param_name)
        if source.shape[1:] != tuple(target.shape[1:]):
            raise ValueError(f"weight {source.name}: checkpoint shape {source.shape} does not fit "
                             f"{tuple(target.shape[1:])} per row")
        target.data[shard.local_offset : shard.local_offset + shard.size].copy_(
            source.rows(shard.source_start, shard.size)
        )


class RowParallelLinear(PackableLinear):
    """Input columns split across ranks; one all-reduce sums the partial
    products, and the (unsplit) bias is added once, after it."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: TensorParallelGroup) -> None:
        super().__init__()
        self.group = group
        self.in_per_rank = in_features // group.world_size
        self.weight = nn.Parameter(torch.empty(out_features, self.in_per_rank))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.matmul(x)
        if self.lora is not None:
            self.lora.apply(x, partial)  # this rank's share of the update joins its share of the product
        out = self.group.all_reduce(partial)
        return out if self.bias is None else out + self.bias

    def load_weight(self, param_name: str, shard_name: str | None, source: WeightSource) -> None:
        target = getattr(self, param_name)
        if param_name == "bias":
            data = source.full()
        else:
            if source.shape[0] != target.shape[0]:
                raise ValueError(f"weight {source.name}: checkpoint shape {source.shape} != {tuple(target.shape)}")
            data = source.columns(self.group.rank * self.in_per_rank, self.in_per_rank)
        if data.shape != target.shape:
            raise ValueError(f"weight {source.name}: checkpoint shape {source.shape} "
                             f"does not fit {tuple(target.shape)}")
        target.data.copy_(data)


class VocabParallelEmbedding(PackableLinear):
    """Rows of the vocabulary split into equal contiguous ranges (the last
    padded with zero rows). Each rank embeds the ids in its range, zeros for
    the others, and an all-reduce assembles the rows. Also the LM head's
    weight when the checkpoint ties them (same ranges)."""

    def __init__(self, vocab_size: int, hidden_size: int, group: TensorParallelGroup) -> None:
        super().__init__()
        self.group = group
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // group.world_size)
        self.vocab_start = group.rank * self.per_rank
        self.rows_held = max(0, min(self.per_rank, vocab_size - self.vocab_start))
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.group.world_size == 1:
            return nn.functional.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.per_rank)
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(out)

    def load_weight(self, param_name: str, shard_name: str | None, source: WeightSource) -> None:
        if source.shape != (self.vocab_size, self.weight.shape[1]):
            raise ValueError(f"weight {source.name}: checkpoint shape {source.shape} != "
                             f"{(self.vocab_size, self.weight.shape[1])}")
        self.weight.data[: self.rows_held].copy_(source.rows(self.vocab_start, self.rows_held))


class ParallelLMHead(VocabParallelEmbedding):
    """The untied LM head: the same vocabulary ranges as the embedding."""


def _is_packable(module: nn.Module) -> bool:
    # An embedding's rows are looked up, so it stays dense (also when it is
    # the tied LM head); the untied head and the projections are only multiplied.
    return isinstance(module, PackableLinear) and (
        not isinstance(module, VocabParallelEmbedding) or isinstance(module, ParallelLMHead)
    )


def vocab_parallel_logits(
    hidden: torch.Tensor, head: VocabParallelEmbedding, vocab_size: int, group: TensorParallelGroup
) -> torch.Tensor | None:
    """Full-vocabulary logits on rank 0 (None elsewhere): each rank's logits
    of its range, gathered, with the padding rows cut off (their logits are
    zeros and must never be sampled)."""
    logits = group.gather_last_dim_to_first(head.matmul(hidden))
    if logits is None or logits.shape[-1] == vocab_size:
        return logits
    return logits[..., :vocab_size]
