"""The worker side of the KV-store connector: moves blocks between the paged
KV cache and the store around the forward (see engine_pod/core/kv_connector.py)."""

from __future__ import annotations

import torch

from engine_pod.core.scheduler_output import KVConnectorMetadata
from kv_store.tensor_codec import block_payload, payload_block
from kv_store.tiered_store import TieredKVStore


class KVConnectorWorker:
    def __init__(self, store: TieredKVStore, kv_cache: torch.Tensor) -> None:
        self.store = store
        self.layout = store.codec.layout
        self.kv_cache = kv_cache  # [layers, 2, blocks, block_size, Hkv, D]
        # Device-to-host copies land in pinned memory on CUDA (faster DMA).
        self._pin = kv_cache.is_cuda

    def _read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """[n, layers, 2, block_size, Hkv, D] on the CPU, each block contiguous."""
        ids = torch.tensor(block_ids, device=self.kv_cache.device)
        blocks = self.kv_cache.index_select(2, ids).permute(2, 0, 1, 3, 4, 5).contiguous()
        if not blocks.is_cuda:
            return blocks
        host = torch.empty(blocks.shape, dtype=blocks.dtype, pin_memory=self._pin)
        host.copy_(blocks)
        return host

    def before_forward(self, meta: KVConnectorMetadata) -> None:
        if meta.offloads:
            blocks = self._read_blocks([block_id for block_id, _ in meta.offloads])
            for (_, block_hash), block in zip(meta.offloads, blocks):
                self.store.host.put(block_hash, self.store.codec.encode(block_hash, block_payload(self.layout, block)))
        if meta.loads:
            ids = torch.tensor([block_id for block_id, _ in meta.loads], device=self.kv_cache.device)
            data = torch.stack([payload_block(self.layout, payload) for _, payload in meta.loads])
            data = data.to(self.kv_cache.device, self.kv_cache.dtype)
            self.kv_cache.index_copy_(2, ids, data.permute(1, 2, 0, 3, 4, 5))

    def after_forward(self, meta: KVConnectorMetadata) -> None:
        if not meta.saves:
            return
        blocks = self._read_blocks([block_id for block_id, _, _ in meta.saves])
        self.store.put_many([(block_hash, block_payload(self.layout, block), sync)
                             for (_, block_hash, sync), block in zip(meta.saves, blocks)])
