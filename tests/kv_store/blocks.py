"""What the kv_store tests share: a small layout, its blocks' payloads and hashes, codecs under two
deployments' keys, the forgeries a reader must refuse, and a Redis tier in a fixed namespace.
Nothing here imports torch: the store moves bytes (tensors are test_tensor_codec.py's)."""

from __future__ import annotations

import random
import struct
import zlib

from kv_store.block_hash import hash_request_tokens
from kv_store.codec import HEADER_SIZE, MAC_BYTES, BlockCodec, BlockLayout
from kv_store.redis_tier import RedisTier, RedisTierConfig
from tessera.internal_secret import InternalSecret

LAYOUT = BlockLayout(b"f" * 16, tp_rank=0, tp_size=1, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8,
                     dtype="bfloat16")
# This deployment's KV key, and another deployment's.
KEY = InternalSecret.from_text("kv-store-tests-deployment-a-0123456789").kv_mac_key
OTHER_KEY = InternalSecret.from_text("kv-store-tests-deployment-b-0123456789").kv_mac_key


def make_payload(seed: int, layout: BlockLayout = LAYOUT) -> bytes:
    """A block's payload of random bytes for the layout, the same for the same seed."""
    return random.Random(seed).randbytes(layout.payload_bytes)


def block_hash(i: int) -> bytes:
    """The hash of the one-block prompt i, i+1, i+2, i+3."""
    return hash_request_tokens(list(range(i, i + 4)), 4)[0]


def make_codec(key: bytes | None = KEY, layout: BlockLayout = LAYOUT) -> BlockCodec:
    return BlockCodec(layout, key)


def genuine_value(i: int) -> bytes:
    """Block i as the shared tiers hold it: encoded and signed with this deployment's key."""
    return make_codec().sign(make_codec().encode(block_hash(i), make_payload(i)))


def tampered_payload(value: bytes) -> bytes:
    """The same header (and MAC), another block's KV: what a forger writes."""
    return value[:HEADER_SIZE] + make_codec().encode(block_hash(9), make_payload(9))[HEADER_SIZE:]


def _v1_forgery(value: bytes) -> bytes:
    """A value in the old format (TKV1, CRC32, no MAC) with a valid header
    and a recomputed CRC32 over a forged payload: what CRC32 used to accept."""
    v1 = struct.Struct("<4sH16sHHIIB4I32sQI")
    lay = LAYOUT
    payload = make_codec().encode(block_hash(9), make_payload(9))[HEADER_SIZE:]
    crc = zlib.crc32(payload, zlib.crc32(block_hash(0)))
    header = v1.pack(b"TKV1", 1, lay.fingerprint, lay.tp_rank, lay.tp_size, lay.block_size, lay.num_layers, 3, 2,
                     lay.block_size, lay.num_kv_heads, lay.head_dim, block_hash(0), len(payload), crc)
    return header + payload


FORGERIES = {
    # name: (how the value under block_hash(0)'s key is made from its genuine value, reason)
    "payload forged under a valid header": (tampered_payload, "mac"),
    "old format with a recomputed CRC32": (_v1_forgery, "format"),
    "signed by another deployment": (lambda v: make_codec(OTHER_KEY).sign(tampered_payload(v)), "mac"),
    "replayed from another deployment": (lambda v: make_codec(OTHER_KEY).sign(v), "mac"),
    "another block's value relabelled": (lambda v: genuine_value(1).replace(block_hash(1), block_hash(0), 1), "mac"),
    "unsigned": (lambda v: v[:HEADER_SIZE - MAC_BYTES] + bytes(MAC_BYTES) + v[HEADER_SIZE:], "mac"),
    "one bit flipped": (lambda v: v[:HEADER_SIZE + 100] + bytes([v[HEADER_SIZE + 100] ^ 0x40]) + v[HEADER_SIZE + 101:],
                        "mac"),
    "truncated payload": (lambda v: v[:-7], "truncated"),
    "truncated header": (lambda v: v[:HEADER_SIZE - 1], "truncated"),
    "another block's value": (lambda v: genuine_value(1), "misaddressed"),
}


def make_redis_tier(url: str, keys_per_read: int = 0, **kw) -> RedisTier:
    """A Redis tier in the namespace of fingerprint "fp", TP rank 0 of 1."""
    return RedisTier(RedisTierConfig(url=url, **kw), namespace="fp:0/1:", keys_per_read=keys_per_read)
