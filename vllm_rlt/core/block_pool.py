"""KV block pool and per-request block tables; every block spans all planes.

Blocks are taken as positions are about to be written (`grow`), never for a request's
whole lifetime up front, and all of a request's blocks return at once (`free`)."""

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

    def missing(self, request_id: str, num_positions: int) -> int:
        """Blocks the request lacks to hold `num_positions` positions."""
        held = len(self._tables.get(request_id, ()))
        return max(0, self.blocks_for(num_positions) - held)

    def can_grow(self, request_id: str, num_positions: int) -> bool:
        return self.missing(request_id, num_positions) <= len(self._free)

    def grow(self, request_id: str, num_positions: int) -> list[tuple[int, int]]:
        """Take the blocks the request lacks for `num_positions` positions; returns each new
        block as (its index in the request's table, its id)."""
        count = self.missing(request_id, num_positions)
        if count > len(self._free):
            raise RuntimeError(f"need {count} blocks, {len(self._free)} free")
        table = self._tables.setdefault(request_id, [])
        start = len(table)
        table.extend(self._free.pop() for _ in range(count))
        return list(enumerate(table[start:], start))

    def free(self, request_id: str) -> None:
        blocks = self._tables.pop(request_id, None)
        if blocks:
            self._free.extend(reversed(blocks))

    def block_table(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    def all_free(self) -> bool:
        return len(self._free) == self.num_blocks and not self._tables
