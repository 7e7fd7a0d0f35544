"""Serial reference implementation (oracle) of the engine's semantics contract (DESIGN §3, §6)."""
