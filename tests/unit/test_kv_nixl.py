"""engine/disagg/nixl_connector.py: the descriptors of the runs one READ moves, and, where the nixl
package is installed, a decode pool that reads a prefill pool's blocks through NIXL bit
for bit, every plane, nothing else touched."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from tests.conftest import pool_entries
from vllm_rlt.engine.disagg.links import KVLinks
from vllm_rlt.engine.disagg.nixl_connector import NixlConnector, _descriptors
from vllm_rlt.worker.kv_pool import KVBlocks, KVPool


def test_descriptors_name_every_tensor_plane_and_run():
    regions = np.array([[1000, 0, 3], [5000, 0, 3]], dtype=np.int64)
    runs = _descriptors(regions, np.array([2, 7]), np.array([1, 3]), 2, 10, 8)
    assert runs.tolist() == [
        [1016, 8, 3], [1056, 24, 3], [1096, 8, 3], [1136, 24, 3],
        [5016, 8, 3], [5056, 24, 3], [5096, 8, 3], [5136, 24, 3],
    ]  # fmt: skip


def test_a_nixl_pool_of_another_geometry_is_refused_by_name():
    pytest.importorskip("nixl._api")
    from vllm_rlt.engine.disagg.links import OpenedPools

    prefill = _pool(0, 6)
    shared = NixlConnector().share(prefill)
    try:
        for field, change in [
            ("block_size", {"block_size": 8}),
            ("geometry", {"dtype": "torch.float16"}),
            ("regions", {"regions": shared.handle.regions[:1]}),
            ("planes", {"planes": 0}),
        ]:
            handle = msgspec.structs.replace(shared.handle, pool_id=field, **change)
            with pytest.raises(ValueError, match=field):
                OpenedPools(lambda: _pool(1, 8)).open(handle)
    finally:
        shared.close()
    with pytest.raises(ValueError, match="kv_connector must be one of auto, torch, nixl"):
        KVLinks(lambda: prefill, 0).share("nccl")


def _pool(seed: int, blocks: int) -> KVPool:
    generator = torch.Generator().manual_seed(seed)
    shape = (2 * blocks * 4, 3, 8)  # two planes of `blocks` blocks of 4 positions
    k = [torch.randn(shape, generator=generator) for _ in range(2)]
    v = [torch.randn(shape, generator=generator) for _ in range(2)]
    return KVPool(k, v, planes=2, block_size=4)


def test_a_decode_pool_reads_a_prefill_pools_blocks_through_nixl():
    pytest.importorskip("nixl._api")
    from vllm_rlt.engine.disagg.links import OpenedPools

    prefill, decode = _pool(0, 6), _pool(1, 8)
    untouched = [t.clone() for t in (*decode.k, *decode.v)]
    shared = NixlConnector().share(prefill)
    try:
        pools = OpenedPools(lambda: decode)
        peer = pools.open(shared.handle)
        assert peer.geometry == decode.geometry and pools.open(shared.handle) is peer
        sources, targets = [4, 5, 1], [0, 6, 7]
        peer.read_into(KVBlocks(sources, 10, 0), targets, 4)  # the first block was a hit
        read = pool_entries(decode, targets, 10, 4)
        written = pool_entries(prefill, sources, 10, 4)
        for ours, theirs, before in zip(
            [*decode.k, *decode.v], [*prefill.k, *prefill.v], untouched, strict=True
        ):
            assert torch.equal(ours[read], theirs[written])
            others = torch.ones(ours.shape[0], dtype=torch.bool)
            others[read] = False
            assert torch.equal(ours[others], before[others])
        with pytest.raises(Exception):  # noqa: B017 - NIXL's own error for a bad address
            peer.read_into(KVBlocks([10**6], 4, 0), targets, 0)  # far outside its pool
        peer.read_into(KVBlocks(sources, 10, 0), targets, 0)  # a failure stays its own
        everything = pool_entries(prefill, sources, 10)
        assert torch.equal(decode.v[1][pool_entries(decode, targets, 10)], prefill.v[1][everything])
        pools.forget(shared.handle.pool_id)  # its prefill core was lost
        with pytest.raises(Exception):  # noqa: B017 - NIXL's own error for an unknown agent
            peer.read_into(KVBlocks(sources, 10, 0), targets, 4)
    finally:
        shared.close()
