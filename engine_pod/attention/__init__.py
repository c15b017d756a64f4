"""Attention backends over the paged KV cache."""

from engine_pod.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    get_attention_backend,
)

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
