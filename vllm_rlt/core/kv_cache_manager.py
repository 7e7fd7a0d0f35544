"""KV block pool and per-request block tables.

A block holds `block_size` positions of whatever the cache's block spans: every loop plane
(LAST_EXITED) or one plane (SHARED, SHARED_DECODE). A table is keyed by its owner: the
request id, or under SHARED_DECODE also (request id, loop) for the per-loop tables a prompt
holds while it prefills.

Blocks are taken as positions are about to be written (`grow`), never for a request's whole
lifetime up front. With prefix caching, a full block of prompt positions is registered under
a hash chain of its tokens once every loop has written it (prompt positions always run at
full depth, so its K/V is the same whoever computed it); a later request whose prompt starts
with the same blocks shares them (`match_prefix`). A block nobody holds but that is cached
stays findable until the pool needs it: free blocks are taken first, then cached ones, least
recently released first."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Sequence


def block_hashes(
    salt: bytes, token_ids: list[int], block_size: int, known: Sequence[bytes] = ()
) -> list[bytes]:
    """The chained hash of each full block of `token_ids`: sha256 of the previous block's
    hash and this block's ids (the first block chains from `salt`: model, layout, dtype).
    `known` are those of its first blocks, already computed."""
    hashes = list(known)
    previous = hashes[-1] if hashes else salt
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        block = array("q", token_ids[start : start + block_size]).tobytes()
        previous = hashlib.sha256(previous + block).digest()
        hashes.append(previous)
    return hashes


class KVCacheManager:
    """Owns the free list, reference counts, each request's block table, and the hashes of
    the cached blocks."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # held by none, unhashed
        self._evictable: OrderedDict[int, None] = OrderedDict()  # held by none, hashed
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._tables: dict[Hashable, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request may take now (cached blocks nobody holds count: they can go)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of)

    def blocks_for(self, num_positions: int) -> int:
        return max(1, -(-num_positions // self.block_size))

    def missing(self, owner: Hashable, num_positions: int) -> int:
        """Blocks the table of `owner` lacks to hold `num_positions` positions."""
        held = len(self._tables.get(owner, ()))
        return max(0, self.blocks_for(num_positions) - held)

    def positions_held(self, owner: Hashable) -> int:
        """Positions the blocks of `owner`'s table hold."""
        return len(self._tables.get(owner, ())) * self.block_size

    def grow(self, owner: Hashable, num_positions: int) -> list[tuple[int, int]]:
        """Take the blocks the table of `owner` lacks for `num_positions` positions; returns
        each new block as (its index in the table, its id)."""
        count = self.missing(owner, num_positions)
        if count > self.num_free_blocks:
            raise RuntimeError(f"need {count} blocks, {self.num_free_blocks} free")
        table = self._tables.setdefault(owner, [])
        start = len(table)
        for _ in range(count):
            block = self._take()
            self._refs[block] = 1
            table.append(block)
        return list(enumerate(table[start:], start))

    def _take(self) -> int:
        if self._free:
            return self._free.pop()
        block, _ = self._evictable.popitem(last=False)  # least recently released
        del self._block_of[self._hash_of.pop(block)]
        return block

    # ----------------------------------------------------------------- prefix caching
    def count_hits(self, hashes: list[bytes]) -> int:
        """How many leading blocks of a prompt with these hashes are cached."""
        hits = 0
        for block_hash in hashes:
            if block_hash not in self._block_of:
                break
            hits += 1
        return hits

    def free_among_hits(self, hashes: list[bytes]) -> int:
        """Of the cached blocks these leading hashes find, how many nobody holds: counted as
        free now, they stop being free once matched."""
        return sum(
            1 for h in hashes[: self.count_hits(hashes)] if self._refs[self._block_of[h]] == 0
        )

    def match_prefix(self, request_id: str, hashes: list[bytes]) -> list[tuple[int, int]]:
        """Start an empty table with the cached blocks of the prompt's first `len(hashes)`
        blocks that are cached; returns them as (index, block id)."""
        if request_id in self._tables:
            raise RuntimeError(f"request {request_id!r} already holds blocks")
        table = self._tables[request_id] = []
        for block_hash in hashes[: self.count_hits(hashes)]:
            block = self._block_of[block_hash]
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
            table.append(block)
        return list(enumerate(table))

    def register(self, request_id: str, index: int, block_hash: bytes) -> None:
        """Block `index` of the request holds the K/V of the prompt block with this hash,
        from now on (in stream order). A prompt another request is computing at the same
        time keeps the first block registered; its copy stays private."""
        block = self._tables[request_id][index]
        if block_hash not in self._block_of and block not in self._hash_of:
            self._block_of[block_hash] = block
            self._hash_of[block] = block_hash

    def uncache_private(self, owner: Hashable) -> None:
        """Drop from the prefix cache the blocks only `owner` holds: a pass that failed may
        not have written K/V that was registered when it was scheduled."""
        for block in self._tables.get(owner, ()):
            if self._refs[block] == 1 and block in self._hash_of:
                del self._block_of[self._hash_of.pop(block)]

    # ----------------------------------------------------------------- release
    def free(self, owner: Hashable) -> None:
        """Release the blocks of `owner`'s table; the last blocks of a prompt go first when
        the pool later needs cached ones back (released in reverse order)."""
        for block in reversed(self._tables.pop(owner, [])):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt block (their K/V came from weights since replaced);
        False, and nothing changed, while some request holds blocks."""
        if self._tables:
            return False
        self.forget_cached_prefixes()
        return True

    def forget_cached_prefixes(self) -> None:
        """Make every cached block unfindable, those requests hold included (new weights
        while requests are frozen in flight): held ones go to the free list once freed."""
        self._free.extend(self._evictable)
        self._evictable.clear()
        self._hash_of.clear()
        self._block_of.clear()

    def lend(self, owner: Hashable, borrower: Hashable) -> None:
        """Move `owner`'s table, references and all, to `borrower`: freeing `owner` then
        keeps the blocks; freeing `borrower` gives them back."""
        if borrower in self._tables:
            raise RuntimeError(f"{borrower!r} already holds blocks")
        self._tables[borrower] = self._tables.pop(owner, [])

    def share(self, owner: Hashable, borrower: Hashable, first: int, count: int) -> list[int]:
        """Give `borrower` blocks [first, first + count) of `owner`'s table as well, one
        more reference each: they stay until both tables are freed. Returns them."""
        if borrower in self._tables:
            raise RuntimeError(f"{borrower!r} already holds blocks")
        blocks = self._tables[owner][first : first + count]
        for block in blocks:
            self._refs[block] += 1
        self._tables[borrower] = list(blocks)
        return list(blocks)

    def block_table(self, request_id: Hashable) -> list[int]:
        return self._tables.get(request_id, [])

    def all_free(self) -> bool:
        return self.num_free_blocks == self.num_blocks and not self._tables
