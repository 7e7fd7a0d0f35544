"""Loop ops behind a small registry: paged attention over the plane-indexed KV cache, plus
the norms and activation that backends may fuse; ops/base.py is the contract each backend
keeps."""

from vllm_rlt.ops.metadata import AttentionMetadata
from vllm_rlt.ops.registry import available_backends, get_backend

__all__ = ["AttentionMetadata", "available_backends", "get_backend"]
