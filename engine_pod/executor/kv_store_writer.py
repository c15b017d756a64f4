"""The KV store's writes of one step, in the engine core's process: the
blocks every rank read back (engine_pod/worker/kv_connector_worker.py),
assembled into whole blocks (engine_pod/worker/kv_shards.py) and put into the
store before the step's outputs return, so a prefill pod's blocks are in
Redis before its first token leaves the pod (or, on the direct channel,
queued for its decode pod, whose reply that token's response waits for:
engine_pod/server/grpc_service.py)."""

from __future__ import annotations

from engine_pod.core.scheduler_output import KVConnectorMetadata, KVConnectorOutput
from engine_pod.worker.kv_shards import assemble_blocks
from kv_store.tensor_codec import block_payload
from kv_store.tiered_store import TieredKVStore


def put_step_blocks(store: TieredKVStore, meta: KVConnectorMetadata, outputs: list[KVConnectorOutput]) -> None:
    """Offloaded blocks go to the host tier, saved ones to every tier
    (synchronously to Redis where the save asks for it). ``outputs``: every
    rank's, in rank order."""
    layout = store.codec.layout
    if meta.offloads:
        blocks = assemble_blocks([o.offloaded for o in outputs], layout.num_kv_heads, layout.num_layers)
        for (_, block_hash), block in zip(meta.offloads, blocks):
            store.host.put(block_hash, store.codec.encode(block_hash, block_payload(layout, block)))
    if meta.saves:
        blocks = assemble_blocks([o.saved for o in outputs], layout.num_kv_heads, layout.num_layers)
        store.put_many([(block_hash, block_payload(layout, block), sync)
                        for (_, block_hash, sync), block in zip(meta.saves, blocks)], meta.transfers)
