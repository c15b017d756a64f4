"""Attention backends over the paged KV cache."""

from engine_pod.attention.abstract import AttentionBackend, AttentionMetadata
from engine_pod.attention.selector import get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
