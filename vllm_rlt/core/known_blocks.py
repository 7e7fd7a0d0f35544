"""Which leading prompt blocks a request already has when the scheduler admits it, and
which of its blocks enter the prefix cache. A new or resumed request takes the cache's
hits; an imported one (prefill/decode disaggregation: its K/V computed by another engine
core, `Request.kv_import`) takes the whole prompt blocks this core holds, and the rest is
copied in at admission, once the blocks read for it early have landed."""

from __future__ import annotations

import hashlib

from vllm_rlt.core.kv_cache_manager import KVCacheManager, block_hashes
from vllm_rlt.core.request import Request


class KnownBlocks:
    """The scheduler's prefix-cache questions, for one pool."""

    def __init__(
        self,
        kv: KVCacheManager,
        cache_salt: bytes,
        table_planes: int,
        chunk_limit: int,
        seeded: bool = False,
    ) -> None:
        self.kv = kv
        self.cache_salt = cache_salt  # what else shapes a block's K/V: model, layout, dtype
        self.seeded = seeded  # and the request's seed (a drawn initial state)
        self.table_planes = table_planes  # block tables per slot (see KVGeometry)
        self.chunk_limit = chunk_limit  # positions of a prefill chunk, at most

    @property
    def caches_prompts(self) -> bool:
        """Prompt blocks computed here serve later prompts: the prefix cache is on and a
        request has one table. Under shared_decode a prompt's per-loop planes are gone once
        it is done, so the cache holds only final planes handed over by prefill cores,
        which serve imports alone."""
        return self.kv.enable_caching and self.table_planes == 1

    def hits(self, request: Request) -> int:
        """Leading prompt blocks `request` takes from the prefix cache on admission."""
        if request.kv_import is not None:
            return self._import_hits(request)
        return self._usable_hits(request)

    def _import_hits(self, request: Request) -> int:
        """Leading whole prompt blocks of an imported request this core's prefix cache
        holds (every plane an import brings: all of them, or under shared_decode the final
        one): they are not copied."""
        if not self.kv.enable_caching:
            return 0
        hashes = self._hashes(request)
        return self.kv.count_hits(hashes[: request.prompt_len // self.kv.block_size])

    def _usable_hits(self, request: Request) -> int:
        """Leading prompt blocks the prefix cache holds, as many as may be skipped: a
        request with no token yet must still compute its last prompt position (it samples
        the first token there)."""
        if not self.caches_prompts:
            return 0
        hashes = self._hashes(request)
        if request.prompt_logprobs is not None:
            return 0  # they come from computing every prompt position (its blocks still
            # enter the cache for others)
        # At least one position is left to compute, so the request starts as a prefill that
        # takes its blocks like any other (for a resumed request that replays nothing, the
        # end of its prompt is recomputed).
        return self.kv.count_hits(hashes[: (request.prefill_len - 1) // self.kv.block_size])

    def first_chunk_blocks(self, request: Request, hits: int, decode_rows: int) -> int:
        """Blocks admission takes from the free count for the first chunk: the new ones (it
        starts after the `hits` cached blocks and ends with the prompt, or for a resumed
        request whose cache covers the prompt, within its replay), plus the cached ones that
        nobody holds (matching them takes them out of the free count); under SHARED_DECODE
        every loop's table takes the new ones. An import decodes at once: its prompt and
        first input."""
        if request.kv_import is not None:
            new = self.kv.blocks_for(self.imported_positions(request, decode_rows)) - hits
        else:
            cached = hits * self.kv.block_size
            segment_end = request.prompt_len if cached < request.prompt_len else request.prefill_len
            end = min(segment_end, cached + self.chunk_limit)
            new = (self.kv.blocks_for(end) - hits) * self.table_planes
        if hits and request.block_hashes is not None:
            new += self.kv.free_among_hits(request.block_hashes[:hits])
        return new

    def take(self, request: Request, hits: int, row: int) -> list[tuple[int, int, int]] | None:
        """Start the table of `request`, just placed, with its first `hits` cached blocks:
        the block updates of its device table row `row` (None: no prefix cache serves it)."""
        if not (self.caches_prompts or (request.kv_import is not None and self.kv.enable_caching)):
            return None
        assert request.block_hashes is not None
        matched = self.kv.match_prefix(request.request_id, request.block_hashes[:hits])
        request.num_registered = hits
        request.num_prefilled = hits * self.kv.block_size
        if request.num_cached_tokens is None:
            request.num_cached_tokens = request.num_prefilled
        return [(row, index, block) for index, block in matched]

    def _hashes(self, request: Request) -> list[bytes]:
        if request.block_hashes is None:
            salt = self.cache_salt
            if self.seeded:
                salt = hashlib.sha256(
                    salt + request.seed.to_bytes(8, "little", signed=True)
                ).digest()
            request.block_hashes = block_hashes(salt, request.prompt_token_ids, self.kv.block_size)
        return request.block_hashes

    def register(self, request: Request) -> None:
        """Register the whole prompt blocks `request` has completed so far."""
        assert request.block_hashes is not None
        done = min(request.num_prefilled, request.prompt_len) // self.kv.block_size
        for index in range(request.num_registered, done):
            self.kv.register(request.request_id, index, request.block_hashes[index])
        request.num_registered = max(request.num_registered, done)

    def register_imported(self, request: Request) -> None:
        """An admitted import's copy is queued, in stream order before any pass: its whole
        prompt blocks enter the prefix cache (not before: an import preempted in the round
        that admitted it, or whose admission failed, never copied them)."""
        if self.kv.enable_caching:
            self.register(request)

    @staticmethod
    def awaits_reads(request: Request) -> bool:
        """An import whose prompt blocks read early are still on their way: not admitted,
        and nobody is preempted for it, until they have landed."""
        return request.kv_import is not None and request.kv_import.awaits_reads()

    @staticmethod
    def imported_positions(request: Request, decode_rows: int) -> int:
        """Positions an imported request holds blocks for on admission: those it brings
        (its prompt and its decoded inputs) and those its next decode writes (one per
        speculation lane, `decode_rows`)."""
        return min(request.prefill_len + decode_rows, request.reserved_positions)
