"""Serial reference (oracle) of the engine's semantics contract (docs/design.md §3, §6)."""
