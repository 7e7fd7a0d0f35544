"""Exit policies: one module per policy, each keeping its own per-slot state, and the
registry that names them (`registry.py`)."""
