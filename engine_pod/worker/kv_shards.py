"""A rank's share of whole KV blocks: the one home of slicing and assembling.

The KV store holds whole blocks (every layer, every KV head: the value a
one-rank engine stores) whatever the engine's layout, so engines of any TP
and PP degree share them. Under TP each rank holds only some heads
(model/parallel_layers.py's ``kv_head_range``; with more ranks than KV heads,
neighbouring ranks hold the same head); under PP each stage holds only its
layers (distributed/parallel_state.stage_layers). On load a rank copies its
own layers and heads out of the whole block; on save the executor assembles
the whole block from every rank's share, each (layer, head) taken once, from
the first rank that holds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RankBlocks:
    """Some blocks' KV as one rank holds them, on the CPU."""

    heads: range
    """The model's KV heads ``tensor`` holds (model/parallel_layers.kv_head_range)."""
    tensor: torch.Tensor
    """[blocks, len(layers), 2, block_size, len(heads), head dim], contiguous."""
    layers: range | None = None
    """The model's decoder layers ``tensor`` holds (its pipeline stage's); None: all of them."""

    def __reduce__(self):
        # Crosses a worker's reply pipe as its raw bytes: torch's own reduction
        # would put every step's tensor into a fresh shared-memory segment and
        # pass its file descriptor through a side channel.
        raw = self.tensor.contiguous().view(torch.uint8).numpy()
        return (_rebuild, (self.heads, self.tensor.dtype, tuple(self.tensor.shape), raw, self.layers))


def _rebuild(heads: range, dtype: torch.dtype, shape: tuple[int, ...], raw, layers: range | None) -> RankBlocks:
    return RankBlocks(heads, torch.from_numpy(raw).view(dtype).view(shape), layers)


def rank_share(blocks: torch.Tensor, heads: range, layers: range | None = None) -> torch.Tensor:
    """The ``layers`` (None: all) and ``heads`` of whole blocks
    [blocks, layers, 2, block_size, all KV heads, head dim] (a view)."""
    if layers is not None:
        blocks = blocks[:, layers.start: layers.stop]
    return blocks[..., heads.start: heads.stop, :]


def assemble_blocks(shards: list[RankBlocks], num_kv_heads: int, num_layers: int | None = None) -> torch.Tensor:
    """Whole blocks [blocks, num_layers, 2, block_size, num_kv_heads, head dim]
    from every rank's share (in rank order: stage by stage, TP rank within
    each), each head of each stage's layers from the first rank that holds
    it. One rank holding every layer and head: its tensor as it is."""
    first = shards[0].tensor
    num_layers = first.shape[1] if num_layers is None else num_layers
    if len(shards) == 1 and len(shards[0].heads) == num_kv_heads and first.shape[1] == num_layers:
        return first
    whole = torch.empty((first.shape[0], num_layers, *first.shape[2:-2], num_kv_heads, first.shape[-1]),
                        dtype=first.dtype)
    by_layers: dict[range, list[RankBlocks]] = {}
    for shard in shards:
        by_layers.setdefault(shard.layers or range(num_layers), []).append(shard)
    covered = 0  # layers [0, covered) are in place; stages come in layer order
    for layers, stage in by_layers.items():
        if layers.start != covered:
            raise ValueError(f"no rank holds layer {covered} of {num_layers}")
        _assemble_heads(stage, num_kv_heads, whole[:, layers.start: layers.stop])
        covered = layers.stop
    if covered != num_layers:
        raise ValueError(f"the ranks hold layers [0, {covered}) of {num_layers}")
    return whole


def _assemble_heads(shards: list[RankBlocks], num_kv_heads: int, out: torch.Tensor) -> None:
    """Fill ``out`` (one stage's layers of the whole blocks) from that stage's
    ranks' heads, each head from the first rank that holds it."""
    filled = 0  # heads [0, filled) are in place; ranks' ranges only move forward
    for shard in shards:
        heads = shard.heads
        if heads.stop <= filled:
            continue  # a replica of heads already taken
        if heads.start > filled:
            raise ValueError(f"no rank holds KV head {filled} of {num_kv_heads}")
        out[..., filled: heads.stop, :] = shard.tensor[..., filled - heads.start:, :]
        filled = heads.stop
    if filled != num_kv_heads:
        raise ValueError(f"the ranks hold KV heads [0, {filled}) of {num_kv_heads}")
