"""KV block pool and per-request block tables; every block spans all planes."""

from __future__ import annotations


class KVCacheManager:
    """Owns the free list and each request's block table, and the all-free invariant."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_positions: int) -> int:
        return max(1, -(-num_positions // self.block_size))

    def can_allocate(self, num_positions: int) -> bool:
        return self.blocks_for(num_positions) <= len(self._free)

    def allocate(self, request_id: str, num_positions: int) -> list[int]:
        """Reserve blocks for the request's whole lifetime (full reservation at admission)."""
        if request_id in self._tables:
            raise RuntimeError(f"request {request_id!r} already holds blocks")
        count = self.blocks_for(num_positions)
        if count > len(self._free):
            raise RuntimeError(f"need {count} blocks, {len(self._free)} free")
        blocks = [self._free.pop() for _ in range(count)]
        self._tables[request_id] = blocks
        return blocks

    def free(self, request_id: str) -> None:
        blocks = self._tables.pop(request_id, None)
        if blocks:
            self._free.extend(reversed(blocks))

    def block_table(self, request_id: str) -> list[int]:
        return self._tables[request_id]

    def all_free(self) -> bool:
        return len(self._free) == self.num_blocks and not self._tables
