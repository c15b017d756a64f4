"""The worker side of the KV-store connector: moves blocks between this
rank's paged KV cache and the step's metadata around the forward (see
engine_pod/core/kv_connector.py).

The store stays in the engine core's process and holds whole blocks (every
layer, every KV head). Loads arrive whole in the metadata and each rank copies
in its own layers' heads; blocks to offload or save are read back as this rank's share and
returned with the step's output, for the executor to assemble and put into
the store (engine_pod/executor/kv_store_writer.py). One path at any TP
degree: at TP=1 the rank's heads are the whole block.
"""

from __future__ import annotations

import torch

from engine_pod.core.scheduler_output import KVConnectorMetadata, KVConnectorOutput
from engine_pod.worker.kv_shards import RankBlocks, rank_share
from kv_store.codec import BlockLayout
from kv_store.tensor_codec import payload_block


class KVConnectorWorker:
    def __init__(self, layout: BlockLayout, kv_cache: torch.Tensor, heads: range, layers: range) -> None:
        """``layout``: the store's (whole blocks); ``heads`` and ``layers``: the
        model's KV heads and decoder layers this rank's cache holds."""
        self.layout = layout
        self.kv_cache = kv_cache  # [this stage's layers, 2, blocks, block_size, this rank's Hkv, D]
        self.heads = heads
        self.layers = layers
        # Device-to-host copies land in pinned memory on CUDA (faster DMA).
        self._pin = kv_cache.is_cuda
        # Read in before_forward (loads and the forward may overwrite them), returned after it.
        self._offloaded: RankBlocks | None = None

    def _read_blocks(self, block_ids: list[int]) -> RankBlocks:
        """This rank's heads of the blocks, [n, layers, 2, block_size, Hkv, D] on the CPU, each contiguous."""
        ids = torch.tensor(block_ids, device=self.kv_cache.device)
        blocks = self.kv_cache.index_select(2, ids).permute(2, 0, 1, 3, 4, 5).contiguous()
        if blocks.is_cuda:
            host = torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=self._pin)
            host.copy_(blocks)
            blocks = host
        return RankBlocks(self.heads, blocks, self.layers)

    def before_forward(self, meta: KVConnectorMetadata) -> None:
        if meta.offloads:
            self._offloaded = self._read_blocks([block_id for block_id, _ in meta.offloads])
        if meta.loads:
            ids = torch.tensor([block_id for block_id, _ in meta.loads], device=self.kv_cache.device)
            whole = torch.stack([payload_block(self.layout, payload) for _, payload in meta.loads])
            data = rank_share(whole, self.heads, self.layers).to(self.kv_cache.device, self.kv_cache.dtype)
            self.kv_cache.index_copy_(2, ids, data.permute(1, 2, 0, 3, 4, 5))

    def after_forward(self, meta: KVConnectorMetadata) -> KVConnectorOutput | None:
        """The blocks the store takes from this step: this rank's heads of
        the offloaded and the just-filled saved blocks (None: none)."""
        if not meta.reads_blocks:
            return None
        offloaded, self._offloaded = self._offloaded, None
        saved = self._read_blocks([block_id for block_id, _, _ in meta.saves]) if meta.saves else None
        return KVConnectorOutput(offloaded, saved)
