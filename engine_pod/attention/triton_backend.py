"""Paged attention in triton kernels: the GPU engine's hot path.

Per layer: one kernel scatters the new K/V into the cache, then one launch
attends the decodes and one the prefill chunks (see triton_ops/plan.py).
Long decode contexts with too few decodes to fill the device split their
keys across programs and a second kernel combines the splits. Everything a
launch needs beyond the metadata (tile maps, split buffers) is built from
the host copies on the step's first layer and kept in ``backend_cache``,
so no layer waits on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_pod.attention.abstract import AttentionBackend, AttentionMetadata
from engine_pod.attention.triton_ops.cache_write import write_kv_cache
from engine_pod.attention.triton_ops.paged_attention import paged_attention
from engine_pod.attention.triton_ops.plan import KernelShape, LaunchPlan, SplitRule, plan_step
from engine_pod.attention.triton_ops.reduce_splits import reduce_splits


def default_split_rule(device: torch.device) -> SplitRule:
    if device.type == "cuda":
        return SplitRule(num_sms=torch.cuda.get_device_properties(device).multi_processor_count)
    # The interpreter runs programs one after another: splitting only adds work.
    return SplitRule(num_sms=1)


@dataclass
class Launch:
    """A planned launch with its tile map (and split buffers) on the device."""

    plan: LaunchPlan
    tile_seq: torch.Tensor
    tile_q_start: torch.Tensor
    # Split launches: float32 partial outputs and log-sum-exps.
    partials: tuple[torch.Tensor, torch.Tensor] | None = None


def _device_launch(plan: LaunchPlan, device: torch.device, num_heads: int, head_dim: int) -> Launch:
    launch = Launch(
        plan,
        torch.from_numpy(plan.tile_seq).to(device, non_blocking=True),
        torch.from_numpy(plan.tile_q_start).to(device, non_blocking=True),
    )
    if plan.num_splits > 1:
        num_tokens = len(plan.tile_seq)  # decodes: one tile, one token each
        launch.partials = (
            torch.empty(num_tokens, num_heads, plan.num_splits, head_dim, dtype=torch.float32, device=device),
            torch.empty(num_tokens, num_heads, plan.num_splits, dtype=torch.float32, device=device),
        )
    return launch


def _check_head_dim_contiguous(**tensors: torch.Tensor) -> None:
    # The kernels address rows through strides but read each head's D values
    # as one contiguous run.
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"triton attention: {name} must be contiguous in its last (head) dimension, "
                             f"got stride {t.stride(-1)}")


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self, split_rule: SplitRule) -> None:
        self.split_rule = split_rule

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata, scale: float) -> torch.Tensor:
        _check_head_dim_contiguous(query=query, key=key, value=value, kv_cache=kv_cache)
        write_kv_cache(key, value, kv_cache, metadata.slot_mapping)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        self.attend(out, query, kv_cache, metadata, scale)
        return out

    def attend(self, out, query, kv_cache, metadata: AttentionMetadata, scale: float) -> None:
        """The attention alone, into ``out``, once the cache holds the step's
        K/V (``tessera bench kernels`` times this)."""
        for launch in self.launches(query, kv_cache, metadata):
            paged_attention(
                out, query, kv_cache, metadata.block_table, metadata.seq_lens, metadata.query_start_loc,
                launch.tile_seq, launch.tile_q_start, launch.plan, scale, launch.partials,
            )
            if launch.partials is not None:
                reduce_splits(out, *launch.partials)

    def launches(self, query, kv_cache, md: AttentionMetadata) -> list[Launch]:
        """The step's launches, planned on its first layer."""
        launches = md.backend_cache.get("triton_launches")
        if launches is None:
            num_heads, head_dim = query.shape[1], query.shape[2]
            shape = KernelShape(num_heads, kv_cache.shape[3], head_dim)
            plans = plan_step(md.query_start_loc_cpu, md.seq_lens_cpu, md.num_decodes, shape, self.split_rule)
            launches = [_device_launch(p, query.device, num_heads, head_dim) for p in plans if p is not None]
            md.backend_cache["triton_launches"] = launches
        return launches
