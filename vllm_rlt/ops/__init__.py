"""Loop ops behind a small registry (`registry.py`): paged attention over the plane-indexed
KV cache, plus the norms and activation that backends may fuse; `base.py` is the contract
each backend keeps."""
