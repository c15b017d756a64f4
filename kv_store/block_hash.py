"""The chained block hash: the single definition (docs/architecture.md, invariant 1).

A block's hash covers its parent's hash, the token ids of the (full) block and
extra keys such as the tenant's cache salt. Chaining makes a hash name the
whole prefix up to and including the block, so equal hashes mean equal KV.
The engine's prefix cache, the gateway's router and the KV store's keys all
call these functions; nothing else may compute a block hash.

The digest is SHA-256 over a canonical byte encoding, never Python's
per-process ``hash()``, so every process and every pod agrees.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes

# Tokens per KV block, the one default: the engine's CacheConfig and --block-size flag, the
# gateway's model.block_size and the CRD's engine.blockSize all take it from here (the engine
# and the gateway must hash prefixes with the same block size for prefix affinity to work).
DEFAULT_BLOCK_SIZE = 16

# Parent of the first block: a fixed, versioned seed. Changing the encoding
# below must change this seed so stale stored blocks can never be matched.
NONE_HASH: BlockHash = hashlib.sha256(b"tessera-block-hash-v1").digest()

# Bytes of a block hash in its block key (block_key).
BLOCK_KEY_BYTES = 8


def block_key(block_hash: BlockHash) -> int:
    """A block hash's first 8 bytes as an unsigned int: how pods push their
    prefix cache's contents to the gateways (Engine.StreamLoad) and how the
    gateway looks a prompt's blocks up in them. 64 bits keep a pod's whole
    cache small on the wire and in the gateway's memory; two blocks sharing a
    key (odds about n**2 / 2**65 for n cached blocks) can only mislead a
    routing choice, never the KV a request reads, which the pod matches by
    the full hash."""
    return int.from_bytes(block_hash[:BLOCK_KEY_BYTES], "big")


def _encode_extra_keys(extra_keys: Sequence[object]) -> bytes:
    """Length-prefixed, type-tagged encoding so ("ab",) and ("a","b") differ."""
    out = bytearray()
    for key in extra_keys:
        if isinstance(key, str):
            data, tag = key.encode("utf-8"), b"s"
        elif isinstance(key, bytes):
            data, tag = key, b"b"
        elif isinstance(key, int) and not isinstance(key, bool):
            data, tag = str(key).encode("ascii"), b"i"
        else:
            raise TypeError(f"block hash extra keys must be str, bytes or int, got {type(key).__name__}")
        out += tag + len(data).to_bytes(4, "little") + data
    return bytes(out)


def hash_block_tokens(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: Sequence[object] = (),
) -> BlockHash:
    """Hash one full block given its parent's hash (None for the first block)."""
    h = hashlib.sha256()
    h.update(NONE_HASH if parent_hash is None else parent_hash)
    tokens = array("q", token_ids)
    h.update(len(tokens).to_bytes(4, "little"))
    h.update(tokens.tobytes())
    h.update(_encode_extra_keys(extra_keys))
    return h.digest()


def request_extra_keys(block_index: int, cache_salt: str | None, adapter: str | None = None) -> tuple[object, ...]:
    """Extra keys of a request's block: the cache salt and the LoRA adapter's
    identity (its fingerprint: KV computed under an adapter's weights is that
    adapter's only) go into the first block only; through the chain they
    separate every later block too."""
    if block_index != 0:
        return ()
    keys: tuple[object, ...] = ("salt", cache_salt) if cache_salt else ()
    if adapter:
        keys += ("lora", adapter)
    return keys


def hash_request_tokens(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    start_block: int = 0,
    parent_hash: BlockHash | None = None,
    adapter: str | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids`` from ``start_block`` on.

    ``adapter`` names the LoRA adapter the tokens run on (None: the base
    model). ``parent_hash`` must be the hash of block ``start_block - 1`` when
    ``start_block > 0``; this lets callers extend a request's hashes
    incrementally as tokens are generated. The trailing partial block is
    never hashed.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if start_block > 0 and parent_hash is None:
        raise ValueError("parent_hash is required when start_block > 0")
    hashes: list[BlockHash] = []
    parent = parent_hash
    num_full = len(token_ids) // block_size
    for i in range(start_block, num_full):
        block = token_ids[i * block_size : (i + 1) * block_size]
        parent = hash_block_tokens(parent, block, request_extra_keys(i, cache_salt, adapter))
        hashes.append(parent)
    return hashes
