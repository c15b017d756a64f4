"""A rank's share of whole KV blocks: the one home of slicing and assembling.

The KV store holds whole blocks (every KV head, the value a TP=1 engine
stores) whatever the engine's TP degree, so engines of any degree share
them. Under TP each rank holds only some heads (model/parallel_layers.py's
``kv_head_range``; with more ranks than KV heads, neighbouring ranks hold
the same head): on load a rank copies its own range out of the whole block;
on save the executor assembles the whole block from every rank's range,
each head taken once, from the first rank that holds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RankBlocks:
    """Some blocks' KV heads as one rank holds them, on the CPU."""

    heads: range
    """The model's KV heads ``tensor`` holds (model/parallel_layers.kv_head_range)."""
    tensor: torch.Tensor
    """[blocks, layers, 2, block_size, len(heads), head dim], contiguous."""

    def __reduce__(self):
        # Crosses a worker's reply pipe as its raw bytes: torch's own reduction
        # would put every step's tensor into a fresh shared-memory segment and
        # pass its file descriptor through a side channel.
        raw = self.tensor.contiguous().view(torch.uint8).numpy()
        return (_rebuild, (self.heads, self.tensor.dtype, tuple(self.tensor.shape), raw))


def _rebuild(heads: range, dtype: torch.dtype, shape: tuple[int, ...], raw) -> RankBlocks:
    return RankBlocks(heads, torch.from_numpy(raw).view(dtype).view(shape))


def rank_heads(blocks: torch.Tensor, heads: range) -> torch.Tensor:
    """The ``heads`` of whole blocks [..., all KV heads, head dim] (a view)."""
    return blocks[..., heads.start: heads.stop, :]


def assemble_blocks(shards: list[RankBlocks], num_kv_heads: int) -> torch.Tensor:
    """Whole blocks [blocks, layers, 2, block_size, num_kv_heads, head dim]
    from every rank's share (in rank order), each head from the first rank
    that holds it. One rank holding every head: its tensor as it is."""
    if len(shards) == 1 and len(shards[0].heads) == num_kv_heads:
        return shards[0].tensor
    first = shards[0].tensor
    whole = torch.empty((*first.shape[:-2], num_kv_heads, first.shape[-1]), dtype=first.dtype)
    filled = 0  # heads [0, filled) are in place; ranks' ranges only move forward
    for shard in shards:
        heads = shard.heads
        if heads.stop <= filled:
            continue  # a replica of heads already taken
        if heads.start > filled:
            raise ValueError(f"no rank holds KV head {filled} of {num_kv_heads}")
        whole[..., filled: heads.stop, :] = shard.tensor[..., filled - heads.start:, :]
        filled = heads.stop
    if filled != num_kv_heads:
        raise ValueError(f"the ranks hold KV heads [0, {filled}) of {num_kv_heads}")
    return whole

