"""The low-rank products of a batch that mixes adapters.

Every token of a step's flattened batch belongs to one request, and each
request runs on one adapter slot or on the base model (slot -1). For each
projection the update is, per token t of slot s:

    out[t] += (x[t] @ A[s]^T) @ (B[s] * scaling[s])^T

On CPU the products run in the model's dtype (bf16 GEMMs run on the matrix
units, an order of magnitude faster than float32 ones, as vLLM runs them)
with B scaled when it is written into its slot (as vLLM does). A step whose
rows all run on one adapter multiplies by that slot's factors alone; a step
that mixes them multiplies every row by all slots' factors side by side and
zeroes the other slots' columns between the two products
(``LoRAMapping.column_mask``): two GEMMs per projection whatever the mix,
where gathering each slot's rows costs a dozen small operators per slot and
projection. The zeroed columns add exact zeros.

With Triton (on GPU, or under its interpreter with the triton attention
backend) one launch pair covers every token, summing in float32 as Hugging
Face PEFT does (triton_ops.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# Slot of a token that runs on the base model only.
NO_SLOT = -1


@dataclass
class LoRAMapping:
    """Which rows of a batch run on which slot, in the forms the paths read."""

    token_slots: torch.Tensor
    """[T] int32: each row's slot, NO_SLOT for the base model."""
    single_slot: int | None
    """The slot of every row, when they all run on one adapter."""
    column_mask: torch.Tensor | None = None
    """CPU steps that mix: [T, slots * max_rank], 1 in the columns of the row's slot, else 0."""
    triton_groups: Any = None
    """triton_ops.SlotGroups: the grouping on the device (the Triton path); None on the torch path."""

    @property
    def num_rows(self) -> int:
        return int(self.token_slots.shape[0])


def build_mapping(
    token_slots: np.ndarray, num_slots: int, max_rank: int, dtype: torch.dtype, device: torch.device,
    use_triton: bool = False, with_mask: bool = True,
) -> LoRAMapping | None:
    """The mapping of a batch whose row i runs on ``token_slots[i]``; None
    when no row runs on an adapter (the step adds nothing). Built once a
    step and read by every projection. ``with_mask``: a mixed step will run
    the two-GEMM path (the row kernel needs no column mask)."""
    used = np.unique(token_slots)
    if used.size == 1 and used[0] == NO_SLOT:
        return None
    slots = torch.from_numpy(token_slots.astype(np.int32)).to(device)
    mapping = LoRAMapping(slots, int(used[0]) if used.size == 1 else None)
    if use_triton:
        from engine_pod.lora.triton_ops import group_tokens_by_slot

        mapping.triton_groups = group_tokens_by_slot(slots, num_slots)
    elif mapping.single_slot is None and with_mask:
        columns = np.zeros((token_slots.size, num_slots, max_rank), dtype=np.float32)
        rows = np.flatnonzero(token_slots != NO_SLOT)
        columns[rows, token_slots[rows]] = 1.0
        mapping.column_mask = torch.from_numpy(columns.reshape(token_slots.size, -1)).to(device, dtype)
    return mapping


def select_rows(mapping: LoRAMapping, rows: np.ndarray) -> LoRAMapping:
    """The mapping of a subset of the rows (the last layer's sampling rows), CPU path."""
    index = torch.from_numpy(rows).to(mapping.token_slots.device)
    mask = None if mapping.column_mask is None else mapping.column_mask[index]
    return LoRAMapping(mapping.token_slots[index], mapping.single_slot, mask)


def shrink(x: torch.Tensor, a_stacked: torch.Tensor, mapping: LoRAMapping, rank: int) -> torch.Tensor:
    """The first product for every projection of a layer at once:
    [T, projections, k] with k = the slot's rank on a one-adapter step, or
    slots * max_rank with the other slots' columns zeroed on a mixed one.
    ``a_stacked``: [projections, slots, max_rank, in]."""
    num_projections, num_slots, max_rank, in_features = a_stacked.shape
    if mapping.single_slot is not None:
        a = a_stacked[:, mapping.single_slot, :rank].reshape(num_projections * rank, in_features)
        return (x @ a.T).view(-1, num_projections, rank)
    assert mapping.column_mask is not None
    shrunk = (x @ a_stacked.view(-1, in_features).T).view(-1, num_projections, num_slots * max_rank)
    return shrunk.mul_(mapping.column_mask[:, None, :])


def expand_into(out: torch.Tensor, shrunk: torch.Tensor, b_t: torch.Tensor, mapping: LoRAMapping) -> None:
    """out += shrunk @ B^T for one projection: ``shrunk`` [T, k] from ``shrink``,
    ``b_t`` [slots, max_rank, out] (each slot's B times its scaling, transposed);
    ``out`` may be a column slice of a wider output (q of a merged q/k/v)."""
    if mapping.single_slot is not None:
        b = b_t[mapping.single_slot, : shrunk.shape[1]]
    else:
        b = b_t.view(-1, b_t.shape[-1])
    # In place, in one pass: oneDNN accumulates the product onto out and rounds once, where
    # out.add_(shrunk @ b) wrote and re-read a [T, out] temporary (3x slower at 2,048 rows).
    out.addmm_(shrunk, b)


def rows_kernel_available(dtype: torch.dtype) -> bool:
    """The cpu backend's row kernel (attention/cpu_ops/lora_rows.cpp) is loaded and takes ``dtype``."""
    return dtype in (torch.float32, torch.bfloat16) and hasattr(torch.ops.tessera_cpu, "lora_rows")


def add_by_rows(out: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, b_t: torch.Tensor, mapping: LoRAMapping,
                ranks: list[int]) -> None:
    """The same update row by row, each row with its own slot's factors only: one call per
    projection, for steps of few rows (ROWS_KERNEL_MAX_ROWS in layers.py)."""
    torch.ops.tessera_cpu.lora_rows(x, lora_a, b_t, mapping.token_slots, ranks, out)
