"""Build the tiered KV store an engine uses, from its config."""

from __future__ import annotations

from engine_pod.config import EngineConfig
from kv_store.codec import FORMAT_VERSION, HEADER_SIZE, BlockCodec, BlockLayout
from kv_store.direct_sender import DirectSender, DirectSenderConfig
from kv_store.fingerprint import model_fingerprint
from kv_store.host_tier import HostMemoryTier
from kv_store.redis_tier import RedisTier
from kv_store.tiered_store import TieredKVStore
from tessera.internal_channel import InternalClient

# Part of a simulated engine's fingerprint: its blocks hold filler, never KV,
# so they live under keys (and carry headers) that no real engine ever reads.
SIMULATED_FINGERPRINT_TAG = "simulated"
READ_CHUNK_BYTES = 16 << 20


def build_kv_store(config: EngineConfig) -> TieredKVStore:
    """Whole blocks (every KV head: rank 0 of 1 in the layout and the keys)
    whatever the engine's TP degree, so engines of any degree share values;
    under TP the executor assembles them from the ranks' heads
    (engine_pod/worker/kv_shards.py)."""
    arch, kv = config.model.arch, config.kv_store
    dtype_name = config.model.kv_dtype_name
    # The format version is part of what a value must match: values of
    # another version live under other keys and are never even fetched.
    extra = f"kv-format-{FORMAT_VERSION}" + (f":{SIMULATED_FINGERPRINT_TAG}" if config.simulated else "")
    fingerprint = model_fingerprint(config.model.path, dtype_name, extra=extra)
    layout = BlockLayout(
        fingerprint=fingerprint, tp_rank=0, tp_size=1, num_layers=arch.num_hidden_layers,
        block_size=config.cache.block_size, num_kv_heads=arch.num_key_value_heads, head_dim=arch.head_dim,
        dtype=dtype_name,
    )
    remote = None
    if kv.redis_url is not None:
        namespace = f"{fingerprint.hex()}:{layout.tp_rank}/{layout.tp_size}:"
        # MGETs of about 16 MiB each: every reply comes well inside the socket timeout.
        keys_per_read = max(1, READ_CHUNK_BYTES // (HEADER_SIZE + layout.payload_bytes))
        remote = RedisTier(kv.redis_tier_config(), namespace=namespace, keys_per_read=keys_per_read)
    codec = BlockCodec(layout, kv.mac_key)
    inbox = HostMemoryTier(kv.inbox_bytes) if kv.inbox_bytes else None
    sender = None
    if codec.can_sign:  # the direct channel's sending half; Redis is its fallback
        # Dialled with the pod's own internal secret (and certificate, under mutual TLS):
        # a peer pod checks them as it checks the gateway's.
        fallback = remote.put_many if remote is not None else None
        sender = DirectSender(codec.sign, fallback, lambda: InternalClient.from_env(kv.peer_tls),
                              DirectSenderConfig(timeout_s=kv.direct_timeout_s))
    return TieredKVStore(codec, HostMemoryTier(kv.host_bytes), remote, kv.write_queue_size, inbox, sender)
