"""Launch planning for the triton backend, from the step's host copies only.

Built once per step (the first layer) and reused by every layer, so no
layer reads a device value back to size its launches. Two launches cover a
step: one over the decodes (the batch's first ``num_decodes`` sequences, one
query token each) and one over the prefill chunks. A launch's programs are
(query tile, KV head[, KV split]); each query tile is up to ``block_q``
tokens of one sequence, times the query heads that share the KV head.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# tl.dot needs at least 16 rows, 16 columns and a 16-deep reduction.
MIN_DOT_DIM = 16


def next_power_of_2(n: int) -> int:
    # triton.next_power_of_2, here without importing triton (plain Python module).
    return 1 << max(0, int(n) - 1).bit_length()


@dataclass(frozen=True)
class TileConfig:
    """Rows of a query tile (query tokens x padded GQA group) and keys per
    inner-loop step."""

    block_m: int
    """Rows of a query tile: query tokens times the padded GQA group."""
    tile_n: int
    """Keys each inner-loop step attends to."""
    num_warps: int = 4
    """Warps per program (triton launch option)."""
    num_stages: int = 2
    """Software-pipelining stages of the inner loop (triton launch option)."""


@dataclass(frozen=True)
class SplitRule:
    """When decodes split their KV sequence across programs (flash-decoding).

    Split when the decode launch alone would leave the device's
    multiprocessors idle (fewer than ``num_sms`` programs) and the longest
    decode context has at least two splits' worth of keys; use enough splits
    for about ``waves`` programs per multiprocessor, each at least
    ``min_keys_per_split`` keys long.
    """

    num_sms: int
    """Multiprocessors of the device (1 under the interpreter: never split)."""
    min_keys_per_split: int = 256
    """Shortest run of keys one split attends to."""
    max_splits: int = 64
    """Most splits of one decode's keys."""
    waves: int = 2
    """Programs per multiprocessor a split launch aims for."""

    def num_splits(self, num_decodes: int, num_kv_heads: int, max_context: int) -> int:
        programs = num_decodes * num_kv_heads
        if programs >= self.num_sms or max_context < 2 * self.min_keys_per_split:
            return 1
        wanted = -(-self.waves * self.num_sms // programs)
        return max(1, min(wanted, max_context // self.min_keys_per_split, self.max_splits))


@dataclass(frozen=True)
class KernelShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def group_pad(self) -> int:
        return next_power_of_2(self.group)


def decode_tile_config(shape: KernelShape) -> TileConfig:
    # One query token per sequence: the rows are the GQA group alone.
    return TileConfig(block_m=max(MIN_DOT_DIM, shape.group_pad), tile_n=64)


def prefill_tile_config(shape: KernelShape) -> TileConfig:
    return TileConfig(block_m=max(64, shape.group_pad), tile_n=64 if shape.head_dim <= 64 else 32)


@dataclass(frozen=True)
class LaunchPlan:
    """One kernel launch over sequences [first_seq, first_seq + n)."""

    config: TileConfig
    block_q: int
    # Per program along grid axis 0: its sequence, and the first query token
    # of its tile (relative to the sequence's first scheduled token).
    tile_seq: np.ndarray
    tile_q_start: np.ndarray
    num_splits: int = 1
    # Keys per split (a multiple of 16) when num_splits > 1.
    split_len: int = 0


def query_tiles(q_lens: np.ndarray, first_seq: int, block_q: int) -> tuple[np.ndarray, np.ndarray]:
    """(sequence, first query token) of every tile of ``block_q`` tokens."""
    tiles_per_seq = -(-q_lens // block_q)
    seqs = np.repeat(np.arange(first_seq, first_seq + len(q_lens)), tiles_per_seq)
    first_tile = np.repeat(np.cumsum(tiles_per_seq) - tiles_per_seq, tiles_per_seq)
    starts = (np.arange(len(seqs)) - first_tile) * block_q
    return seqs.astype(np.int32), starts.astype(np.int32)


def _launch(config: TileConfig, shape: KernelShape, q_lens: np.ndarray, first_seq: int, **split) -> LaunchPlan:
    block_q = config.block_m // shape.group_pad
    seqs, starts = query_tiles(q_lens, first_seq, block_q)
    return LaunchPlan(config, block_q, seqs, starts, **split)


def plan_step(
    query_start_loc: np.ndarray, seq_lens: np.ndarray, num_decodes: int, shape: KernelShape, rule: SplitRule
) -> tuple[LaunchPlan | None, LaunchPlan | None]:
    """(decode launch, prefill launch); either is None when the step has no
    such sequences."""
    q_lens = np.diff(query_start_loc)
    decode = prefill = None
    if num_decodes:
        config = decode_tile_config(shape)
        max_context = int(seq_lens[:num_decodes].max())
        splits = rule.num_splits(num_decodes, shape.num_kv_heads, max_context)
        split = {}
        if splits > 1:
            per_split = -(-max_context // splits)
            split_len = -(-per_split // MIN_DOT_DIM) * MIN_DOT_DIM
            if split_len < max_context:
                split = dict(num_splits=-(-max_context // split_len), split_len=split_len)
        decode = _launch(config, shape, q_lens[:num_decodes], 0, **split)
    if num_decodes < len(q_lens):
        prefill = _launch(prefill_tile_config(shape), shape, q_lens[num_decodes:], num_decodes)
    return decode, prefill
