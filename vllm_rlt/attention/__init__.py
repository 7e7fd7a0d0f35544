"""Paged attention over the plane-indexed KV cache, behind a small backend registry."""

from vllm_rlt.attention.metadata import AttentionMetadata
from vllm_rlt.attention.registry import available_backends, get_backend

__all__ = ["AttentionMetadata", "available_backends", "get_backend"]
