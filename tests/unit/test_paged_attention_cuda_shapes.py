"""The CUDA paged decode attention's launch arithmetic, which must agree with its source
(kernels/csrc/paged_attention.cu): the query-head tile of a group and a block's shared
memory; and that CPU tensors never reach the kernel."""

from __future__ import annotations

import torch

from vllm_rlt.kernels import paged_attention_cuda


def test_a_group_takes_the_smallest_tile_that_holds_it():
    tiles = [paged_attention_cuda.group_tile(h, kv) for h, kv in [(16, 16), (48, 8), (8, 2)]]
    assert tiles == [1, 8, 4]
    assert paged_attention_cuda.group_tile(16, 1) == 0  # 16 a group: no variant
    assert paged_attention_cuda.group_tile(16, 3) == 0  # heads no multiple of KV heads


def test_shared_memory_of_a_block():
    # 4 warps, each: 2 stages x (K, V) x 16 keys of 256 + 16 bytes, then its head's q
    assert paged_attention_cuda.shared_bytes(128, 2, 1) == 4 * (2 * 2 * 16 * 272 + 512)
    # float8 rows of head size 96: 96 + 16 bytes; 8 heads of q a warp
    assert paged_attention_cuda.shared_bytes(96, 1, 8) == 4 * (2 * 2 * 16 * 112 + 8 * 96 * 4)


def test_few_rows_split_their_keys_until_the_launch_has_enough_blocks():
    splits = paged_attention_cuda.decode_splits
    # Ouro's 16 KV heads: 4 blocks a row and run
    assert [splits(r, 16) for r in (1, 4, 32, 64, 256)] == [32, 16, 2, 1, 1]
    # Huginn's 55: 14 blocks a row and run; at most MAX_SPLITS runs
    assert [splits(r, 55) for r in (1, 4, 18, 19)] == [32, 8, 2, 1]
    assert all(splits(r, h) <= paged_attention_cuda.MAX_SPLITS for r in (1, 2) for h in (1, 8))


def test_cpu_tensors_never_take_the_kernel():
    q = torch.zeros(300, 55, 96, dtype=torch.bfloat16)
    cache = torch.zeros(64, 55, 96, dtype=torch.bfloat16)
    assert not paged_attention_cuda.fits_cuda_decode(q, cache, 55)
    assert not paged_attention_cuda.takes_cuda_decode(q, cache, 55, 300)
