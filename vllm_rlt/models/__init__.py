"""Model families (one file each), the checkpoint loader, the registry, the random-weight toy
and the resolution of built-in model names."""
