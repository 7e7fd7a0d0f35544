"""worker/kv_pool.py: the runs of blocks a handover moves (joined where consecutive on both
sides, a prefix hit skipped), and the copy between two pools: long runs as slice copies,
short ones gathered, every layer, K and V and plane, bit for bit, nothing else touched."""

from __future__ import annotations

import pytest
import torch

from vllm_rlt.worker import kv_pool
from vllm_rlt.worker.kv_pool import KVPool, block_runs, copy_kv


def test_runs_join_blocks_consecutive_on_both_sides_and_skip_a_prefix():
    # positions 0..9 in blocks of 4: source blocks 5, 6, 2; target blocks 1, 2, 3
    assert block_runs([5, 6, 2], [1, 2, 3], 0, 10, 4).tolist() == [[20, 4, 8], [8, 12, 2]]
    # from position 4 on (a prefix hit of one block), the last block partly
    assert block_runs([5, 6, 2], [1, 2, 3], 4, 10, 4).tolist() == [[24, 8, 4], [8, 12, 2]]
    assert block_runs([5], [1], 4, 4, 4).shape == (0, 3)


def _pool(blocks: int, seed: int) -> KVPool:
    """2 layers, 2 planes, blocks of 4 positions, 2 heads of 3."""
    generator = torch.Generator().manual_seed(seed)
    shape = (2 * blocks * 4, 2, 3)
    k = [torch.randn(shape, generator=generator) for _ in range(2)]
    v = [torch.randn(shape, generator=generator) for _ in range(2)]
    return KVPool(k, v, planes=2, block_size=4)


@pytest.mark.parametrize(
    "slice_bytes", [1, 10**9, 4 * 2 * 3 * 4 * 2], ids=["slices", "gather", "both"]
)
@pytest.mark.parametrize("start", [0, 4, 6])
def test_copy_moves_every_entry_of_the_positions_and_nothing_else(monkeypatch, slice_bytes, start):
    monkeypatch.setattr(kv_pool, "SLICE_COPY_BYTES", slice_bytes)
    monkeypatch.setattr(kv_pool, "GATHER_PIECE", 5)  # several pieces
    source, target = _pool(8, 0), _pool(10, 1)
    before = [t.clone() for t in (*target.k, *target.v)]
    # 14 positions: blocks 3, 4 | 0 | 6 in the source; 7, 8 | 1 | 2 in the target
    sources, targets = [3, 4, 0, 6], [7, 8, 1, 2]
    copy_kv(source, sources, target, targets, start, 14)
    moved_to = target.entries(targets, 14, start)
    moved_from = source.entries(sources, 14, start)
    untouched = torch.ones(target.k[0].shape[0], dtype=torch.bool)
    untouched[moved_to] = False
    for ours, theirs, old in zip(
        (*target.k, *target.v), (*source.k, *source.v), before, strict=True
    ):
        assert torch.equal(ours[moved_to], theirs[moved_from])
        assert torch.equal(ours[untouched], old[untouched])
