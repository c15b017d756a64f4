"""Tiered, content-addressed KV block store. Home of the one block-hash definition."""

from kv_store.block_hash import (
    DEFAULT_BLOCK_SIZE,
    NONE_HASH,
    BlockHash,
    hash_block_tokens,
    hash_request_tokens,
    request_extra_keys,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "NONE_HASH",
    "BlockHash",
    "hash_block_tokens",
    "hash_request_tokens",
    "request_extra_keys",
]
