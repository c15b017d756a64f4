"""Adapter slots on the model's projections, sharded like the base weights.

``attach_lora`` gives every q/k/v, o, gate/up and down projection layer (of
the rank's pipeline stage) a ``LinearLoRA``: for each checkpoint projection
inside it (q, k and v share one merged GEMM) ``max_loras`` slots of A
[max_rank, in] and B [out, max_rank]. One ``LoRAContext`` per model holds
the slots' ranks and scalings and the step's row-to-slot mapping, which
every projection reads.

The slots are laid out for the path that reads them (punica.py): on CPU the
A of a layer's projections in one tensor [projections, slots, max_rank, in]
(one GEMM shrinks the shared input for all of them) and each B scaled, as
[out, slots, max_rank], in the model's dtype; for Triton A [slots, max_rank,
in] and B [slots, out, max_rank] unscaled, in float32.

Under pipeline parallelism a stage attaches slots to its own decoder layers
only (``stage_layers``), so it holds no other stage's factors, and installing
an adapter writes the factors of those layers (by global layer index) and
skips the rest.

Under tensor parallelism each rank holds its share, so the update needs no
communication of its own:
- column-parallel (q/k/v, gate/up): the full A, and the rows of B that match
  the rank's output rows;
- row-parallel (o, down): the columns of A that match the rank's input
  columns, and the full B; the rank's partial update joins its partial
  product before the layer's all-reduce, which sums both
  (sum_r x_r A_r^T B^T = x A^T B^T).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from engine_pod.lora.adapter import AdapterWeights
from engine_pod.lora.config import LoRAConfig
from engine_pod.lora.punica import (
    LoRAMapping,
    add_by_rows,
    build_mapping,
    expand_into,
    rows_kernel_available,
    select_rows,
    shrink,
)

# Steps of at most this many rows run the row kernel (punica.add_by_rows) where it is loaded: there
# each oneDNN call of the two-GEMM path costs 30-60 us whatever its size, and a mixed step's GEMMs
# multiply every row by every slot's factors; above it the GEMMs win (`bench lora`: 0.74x of the
# base model's throughput at 64 rows, 0.79x at 128 and 0.80x at 256, with the bf16 dot products).
ROWS_KERNEL_MAX_ROWS = 256

# A merged GEMM's shard names and the checkpoint projections they hold (parallel_layers.OutputShard.name).
_SHARD_MODULES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "gate": "gate_proj", "up": "up_proj"}


class LoRAContext:
    """The slots' ranks and scalings, and which rows of this step use which slot."""

    def __init__(self, config: LoRAConfig, dtype: torch.dtype, device: torch.device, use_triton: bool) -> None:
        self.num_slots = config.max_loras
        self.max_rank = config.max_lora_rank
        # The factors' dtype: the model's on CPU, float32 (float64 for a float64 model) for Triton.
        self.dtype = dtype
        self.device = device
        # Triton's kernels (triton_ops.py) rather than torch's GEMMs.
        self.use_triton = use_triton
        # The cpu backend's row kernel for steps of few rows.
        self.use_rows_kernel = device.type == "cpu" and not use_triton and rows_kernel_available(dtype)
        self.ranks = [0] * self.num_slots
        self.scalings = torch.zeros(self.num_slots, dtype=torch.float32, device=device)
        # Set per step by set_mapping: every row of the batch, and the rows that sample.
        self._all_rows: LoRAMapping | None = None
        self._selected_rows: LoRAMapping | None = None

    def set_mapping(self, token_slots: np.ndarray | None, selected: np.ndarray | None) -> None:
        """``token_slots``: each row's slot (None: no adapter this step);
        ``selected``: the rows the last layer keeps (None: all of them)."""
        self._all_rows = self._selected_rows = None
        if token_slots is None:
            return
        self._all_rows = self._build(token_slots)
        if selected is not None and self._all_rows is not None:
            # Triton's device grouping is rebuilt for the subset; the CPU forms are sliced.
            self._selected_rows = self._build(token_slots[selected]) if self.use_triton else select_rows(
                self._all_rows, selected)

    def _build(self, token_slots: np.ndarray) -> LoRAMapping | None:
        # Steps the row kernel takes never read the mask: it is not built for them.
        with_mask = not self.use_rows_kernel or token_slots.size > ROWS_KERNEL_MAX_ROWS
        return build_mapping(token_slots, self.num_slots, self.max_rank, self.dtype, self.device, self.use_triton,
                             with_mask)

    def mapping_for(self, num_rows: int) -> LoRAMapping | None:
        """The mapping of an input of ``num_rows`` rows: the whole batch, or at
        the last layer's o_proj and MLP only the rows that sample."""
        mapping = self._all_rows
        if mapping is None or num_rows == mapping.num_rows:
            return mapping
        return self._selected_rows


@dataclass
class _Projection:
    """One checkpoint projection's slots inside a (merged) layer."""

    module: str  # q_proj, ..., down_proj
    out_offset: int  # its first column in the layer's output
    out_size: int  # its columns (this rank's)
    b_rows: slice  # the rows of the adapter's B this rank holds
    a_columns: slice  # the columns of the adapter's A this rank holds
    lora_a: torch.Tensor  # [slots, max_rank, in (this rank's)]
    lora_b: torch.Tensor  # CPU: (B * scaling)^T as [slots, max_rank, out]; Triton: B as [slots, out, max_rank]


class LinearLoRA(nn.Module):
    """The adapter slots of one projection layer."""

    def __init__(self, ctx: LoRAContext, layer_index: int, in_features: int,
                 outputs: list[tuple[str, int, int, slice]], a_columns: slice) -> None:
        """``outputs``: per projection (module, first output column, columns,
        the adapter's B rows this rank holds)."""
        super().__init__()
        self.ctx = ctx
        self.layer_index = layer_index
        n, s, r = len(outputs), ctx.num_slots, ctx.max_rank
        # CPU: every projection's A in one tensor, each projection's lora_a a view of it.
        self.a_stacked = _zeros(ctx, n, s, r, in_features)
        self.projections = [
            _Projection(module, offset, size, b_rows, a_columns, self.a_stacked[i],
                        _zeros(ctx, s, size, r) if ctx.use_triton else _zeros(ctx, s, r, size))
            for i, (module, offset, size, b_rows) in enumerate(outputs)
        ]

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add the step's low-rank updates of ``x`` to ``out`` (in place)."""
        mapping = self.ctx.mapping_for(x.shape[0])
        if mapping is None:
            return
        if mapping.triton_groups is not None:
            from engine_pod.lora.triton_ops import add_lora_triton

            for p in self.projections:
                add_lora_triton(self._columns(out, p), x, p.lora_a, p.lora_b, mapping.token_slots,
                                self.ctx.scalings, groups=mapping.triton_groups)
            return
        if self.ctx.use_rows_kernel and x.shape[0] <= ROWS_KERNEL_MAX_ROWS:
            for p in self.projections:
                add_by_rows(self._columns(out, p), x, p.lora_a, p.lora_b, mapping, self.ctx.ranks)
            return
        rank = self.ctx.ranks[mapping.single_slot] if mapping.single_slot is not None else self.ctx.max_rank
        shrunk = shrink(x, self.a_stacked, mapping, rank)
        for i, p in enumerate(self.projections):
            expand_into(self._columns(out, p), shrunk[:, i], p.lora_b, mapping)

    @staticmethod
    def _columns(out: torch.Tensor, p: _Projection) -> torch.Tensor:
        return out[:, p.out_offset : p.out_offset + p.out_size]

    def install(self, slot: int, weights: AdapterWeights) -> None:
        """Write an adapter's factors (this rank's share) into ``slot``,
        zeros where it does not target a projection or past its rank."""
        rank, scaling = weights.spec.rank, weights.spec.scaling
        for p in self.projections:
            factors = weights.factors.get((self.layer_index, p.module))
            p.lora_a[slot].zero_()
            p.lora_b[slot].zero_()
            if factors is None:
                continue
            a, b = factors
            p.lora_a[slot, :rank].copy_(a[:, p.a_columns])
            if self.ctx.use_triton:  # scaled as PEFT does, after the products
                p.lora_b[slot, :, :rank].copy_(b[p.b_rows])
            else:  # the CPU path's B carries its scaling
                p.lora_b[slot, :rank].copy_((b[p.b_rows] * scaling).T)


def _column_parallel(ctx: LoRAContext, layer_index: int, linear: nn.Module, in_features: int) -> LinearLoRA:
    outputs = [(_SHARD_MODULES[s.name], s.local_offset, s.size, slice(s.source_start, s.source_start + s.size))
               for s in linear.shards.values()]
    return LinearLoRA(ctx, layer_index, in_features, outputs, slice(None))


def _row_parallel(ctx: LoRAContext, layer_index: int, linear: nn.Module, module: str, out_features: int) -> LinearLoRA:
    start = linear.group.rank * linear.in_per_rank
    return LinearLoRA(ctx, layer_index, linear.in_per_rank, [(module, 0, out_features, slice(None))],
                      slice(start, start + linear.in_per_rank))


def _zeros(ctx: LoRAContext, *shape: int) -> torch.Tensor:
    return torch.zeros(*shape, dtype=ctx.dtype, device=ctx.device)


class ModelLoRA:
    """A model's adapter slots: what the runner installs adapters into and
    sets each step's mapping on."""

    def __init__(self, ctx: LoRAContext, layers: list[LinearLoRA]) -> None:
        self.ctx = ctx
        self.layers = layers

    def install(self, slot: int, weights: AdapterWeights) -> None:
        """Write an adapter into ``slot`` (replacing whatever was there)."""
        for layer in self.layers:
            layer.install(slot, weights)
        self.ctx.ranks[slot] = weights.spec.rank
        self.ctx.scalings[slot] = weights.spec.scaling

    def set_mapping(self, token_slots: np.ndarray | None, selected: np.ndarray | None) -> None:
        self.ctx.set_mapping(token_slots, selected)


def attach_lora(
    model: nn.Module, config: LoRAConfig, model_dtype: torch.dtype, device: torch.device, use_triton: bool = False
) -> ModelLoRA:
    """Give every projection of ``model``'s stage (a LlamaForCausalLM) its slots;
    ``use_triton``: the products run as Triton kernels (the engine's
    attention does too: on GPU, or interpreted in tests)."""
    from engine_pod.lora.adapter import lora_compute_dtype

    dtype = lora_compute_dtype(model_dtype) if use_triton else model_dtype
    ctx = LoRAContext(config, dtype, device, use_triton)
    hidden = model.config.hidden_size
    layers = []
    # This pipeline stage's layers only (the others are weightless placeholders); each keeps its
    # global index, the one an adapter's factors are keyed by.
    for i in model.model.stage_layers:
        attn, mlp = model.model.layers[i].self_attn, model.model.layers[i].mlp
        attn.qkv_proj.lora = _column_parallel(ctx, i, attn.qkv_proj, hidden)
        attn.o_proj.lora = _row_parallel(ctx, i, attn.o_proj, "o_proj", hidden)
        mlp.gate_up_proj.lora = _column_parallel(ctx, i, mlp.gate_up_proj, hidden)
        mlp.down_proj.lora = _row_parallel(ctx, i, mlp.down_proj, "down_proj", hidden)
        layers += [attn.qkv_proj.lora, attn.o_proj.lora, mlp.gate_up_proj.lora, mlp.down_proj.lora]
    return ModelLoRA(ctx, layers)
