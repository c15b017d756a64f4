"""The worker half of the KV connector in a simulated engine: the copies a
real worker makes between its KV cache and the store around a step
(engine_pod/worker/kv_connector_worker.py), with filler bytes standing in
for the KV a simulated engine never computes.

Everything past the payload is real: the host and Redis tiers, the codec's
framing and its MAC. A prefill pod's blocks land in Redis under the chained
block hashes a real pod would use (in a namespace of their own:
engine_pod/engine/kv_store_factory.py), and a decode pod's reads are
verified as a real pod's are before its scheduler counts them as computed.
"""

from __future__ import annotations

from engine_pod.core.scheduler_output import KVConnectorMetadata
from kv_store.tiered_store import TieredKVStore


def filler_payload(block_hash: bytes, size: int) -> bytes:
    """A block's stand-in KV: its hash repeated to ``size`` bytes. Deterministic,
    and different for every block, as real KV is."""
    repeats, rest = divmod(size, len(block_hash))
    return block_hash * repeats + block_hash[:rest]


class SimulatedKVTransfer:
    def __init__(self, store: TieredKVStore) -> None:
        self.store = store
        self._payload_bytes = store.codec.layout.payload_bytes

    def run(self, meta: KVConnectorMetadata) -> None:
        """Offload the blocks evicted this step to the host tier and save the
        ones it fills, as a real worker does. Loads need nothing more: the
        store read and verified their bytes when the scheduler matched them,
        and the simulated KV cache is bookkeeping only."""
        for _, block_hash in meta.offloads:
            value = self.store.codec.encode(block_hash, filler_payload(block_hash, self._payload_bytes))
            self.store.host.put(block_hash, value)
        self.store.put_many([(block_hash, filler_payload(block_hash, self._payload_bytes), sync)
                             for _, block_hash, sync in meta.saves], meta.transfers)
