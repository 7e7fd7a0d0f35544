"""worker/kv_pool.py: the runs of blocks a handover moves (joined where consecutive on both
sides, a prefix hit skipped), and the copy between two pools: long runs as slice copies,
short ones gathered, every layer, K and V and plane, bit for bit, nothing else touched."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import pool_entries
from vllm_rlt.worker import kv_pool
from vllm_rlt.worker.kv_pool import KVPool, block_runs, copy_kv


def test_runs_join_blocks_consecutive_on_both_sides_and_skip_a_prefix():
    # positions 0..9 in blocks of 4: source blocks 5, 6, 2; target blocks 1, 2, 3
    assert block_runs([5, 6, 2], [1, 2, 3], 0, 10, 4).tolist() == [[20, 4, 8], [8, 12, 2]]
    # from position 4 on (a prefix hit of one block), the last block partly
    assert block_runs([5, 6, 2], [1, 2, 3], 4, 10, 4).tolist() == [[24, 8, 4], [8, 12, 2]]
    assert block_runs([5], [1], 4, 4, 4).shape == (0, 3)
    # target blocks of 2 positions: runs break at either side's boundaries, join where both
    # continue (source block 5 = rows 20-23 into target blocks 3, 4 = rows 6-9)
    assert block_runs([5, 1], [3, 4, 0], 0, 6, 4, 2).tolist() == [[20, 6, 4], [4, 0, 2]]


def _pool(blocks: int, seed: int, block_size: int = 4) -> KVPool:
    """2 layers, 2 planes, 2 heads of 3."""
    generator = torch.Generator().manual_seed(seed)
    shape = (2 * blocks * block_size, 2, 3)
    k = [torch.randn(shape, generator=generator) for _ in range(2)]
    v = [torch.randn(shape, generator=generator) for _ in range(2)]
    return KVPool(k, v, planes=2, block_size=block_size)


@pytest.mark.parametrize(
    "slice_bytes", [1, 10**9, 4 * 2 * 3 * 4 * 2], ids=["slices", "gather", "both"]
)
@pytest.mark.parametrize("start", [0, 4, 6])
@pytest.mark.parametrize("block_size", [4, 2])
def test_copy_moves_every_entry_of_the_positions_and_nothing_else(
    monkeypatch, slice_bytes, start, block_size
):
    monkeypatch.setattr(kv_pool, "SLICE_COPY_BYTES", slice_bytes)
    monkeypatch.setattr(kv_pool, "GATHER_PIECE", 5)  # several pieces
    source, target = _pool(8, 0), _pool(20, 1, block_size)
    before = [t.clone() for t in (*target.k, *target.v)]
    # 14 positions: blocks 3, 4 | 0 | 6 in the source; 7, 8 | 1 | 2 in a target of blocks
    # of 4, or 14, 15, 16, 17 | 2, 3 | 4, 5 in one of blocks of 2
    sources = [3, 4, 0, 6]
    targets = [7, 8, 1, 2] if block_size == 4 else [14, 15, 16, 17, 2, 3, 4, 5]
    copy_kv(source, sources, target, targets, start, 14)
    moved_to = pool_entries(target, targets, 14, start)
    moved_from = pool_entries(source, sources, 14, start)
    untouched = torch.ones(target.k[0].shape[0], dtype=torch.bool)
    untouched[moved_to] = False
    for ours, theirs, old in zip(
        (*target.k, *target.v), (*source.k, *source.v), before, strict=True
    ):
        assert torch.equal(ours[moved_to], theirs[moved_from])
        assert torch.equal(ours[untouched], old[untouched])


@pytest.mark.parametrize("slice_bytes", [1, 10**9], ids=["slices", "gather"])
def test_float8_pools_copy_bit_for_bit(monkeypatch, slice_bytes):
    """An fp8 KV cache moves through the same copies (gathers run on its bytes)."""
    monkeypatch.setattr(kv_pool, "SLICE_COPY_BYTES", slice_bytes)

    def fp8(pool: KVPool) -> KVPool:
        k, v = ([t.to(torch.float8_e4m3fn) for t in ts] for ts in (pool.k, pool.v))
        return KVPool(k, v, pool.planes, pool.block_size)

    source, target = fp8(_pool(8, 0)), fp8(_pool(20, 1))
    copy_kv(source, [3, 4, 0, 6], target, [7, 8, 1, 2], 0, 14)
    moved_to = pool_entries(target, [7, 8, 1, 2], 14)
    moved_from = pool_entries(source, [3, 4, 0, 6], 14)
    for ours, theirs in zip((*target.k, *target.v), (*source.k, *source.v), strict=True):
        assert ours.dtype == torch.float8_e4m3fn
        assert torch.equal(ours.view(torch.uint8)[moved_to], theirs.view(torch.uint8)[moved_from])
