"""Prefix caching: requests that share prompt blocks reuse their K/V, and the outputs equal
a run without the cache in every layout and exit mode, including under preemption."""

from __future__ import annotations

import random

import pytest

from tests.conftest import drain
from tests.e2e.test_engine_vs_oracle import POLICIES
from vllm_rlt import CacheConfig, ExitConfig, SamplingParams
from vllm_rlt.core.kv_cache_manager import KVCacheManager, block_hashes

PREFIX = [random.Random(9).randrange(3, 259) for _ in range(13)]  # 3 blocks of 4, and 1 more
SUFFIXES = [[40 + i, 50 + i, 60 + i][: 1 + i % 3] for i in range(6)]


def _run(make_engine, layout, policy, caching, num_blocks=128, waves=True):
    exit_mode, threshold = POLICIES[policy]
    ids = [f"r{i}" for i in range(len(SUFFIXES))]
    traces = {rid: (4, *[1 + (i + j) % 4 for j in range(7)]) for i, rid in enumerate(ids)}
    engine = make_engine(
        layout=layout,
        exit_config=ExitConfig(
            mode=exit_mode, depths_by_request=traces if exit_mode == "trace" else {}
        ),
        num_blocks=num_blocks,
        enable_prefix_caching=caching,
        prefill_chunk_size=4,
        max_num_seqs=3,
        max_num_batched_tokens=64,
    )
    params = SamplingParams(
        max_tokens=8, temperature=0.0, logprobs=2, exit_threshold=threshold, ignore_eos=True
    )
    # Waves: the first request computes the prefix; later ones find it cached.
    if not waves:
        arrivals = {0: [(rid, PREFIX + SUFFIXES[i], params) for i, rid in enumerate(ids)]}
        return engine, drain(engine, arrivals)
    arrivals = {
        4 * i * (i > 0) + 12 * (i > 0): [(rid, PREFIX + SUFFIXES[i], params)]
        for i, rid in enumerate(ids)
    }
    return engine, drain(engine, arrivals)


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_prefix_cache_changes_nothing_but_the_work(make_engine, layout, policy):
    cached_engine, cached = _run(make_engine, layout, policy, caching=True)
    plain_engine, plain = _run(make_engine, layout, policy, caching=False)
    assert cached_engine.scheduler.prefix_hits >= 3 * 4 * (len(SUFFIXES) - 1) // 2
    assert plain_engine.scheduler.prefix_hits == 0
    assert cached_engine.kv.num_cached_blocks > 0  # kept, findable, and counted as free
    for rid, want in plain.items():
        got = cached[rid].outputs[0]
        assert got.token_ids == want.outputs[0].token_ids, rid
        assert got.exit_depths == want.outputs[0].exit_depths, rid
        for a, b in zip(got.logprobs, want.outputs[0].logprobs, strict=True):
            assert a.keys() == b.keys()
            assert all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-5) for t in a)


def test_shared_decode_prompts_neither_find_nor_fill_the_prefix_cache(make_engine):
    """SHARED_DECODE frees a finished prompt's per-loop planes, which a prompt continuing
    its prefix would need: with the cache on, prompts run here neither look it up nor
    enter it (it serves only K/V handed over from prefill cores)."""
    engine, outputs = _run(make_engine, "shared_decode", "ouro_q0.7", caching=True)
    assert engine.kv.enable_caching and not engine.scheduler.known.caches_prompts
    assert engine.scheduler.prefix_queries == engine.scheduler.prefix_hits == 0
    assert engine.kv.num_cached_blocks == 0
    assert all(len(out.outputs[0].token_ids) == 8 for out in outputs.values())


def test_prefix_cache_under_preemption_and_eviction(make_engine):
    """A pool that forces preemptions and evicts cached blocks: same outputs, no leak."""
    small_engine, small = _run(
        make_engine, "last_exited", "ouro_q0.7", caching=True, num_blocks=7, waves=False
    )
    _, plain = _run(make_engine, "last_exited", "ouro_q0.7", caching=False, waves=False)
    assert small_engine.scheduler.num_preemptions > 0
    assert small_engine.scheduler.prefix_hits > 0
    for rid, want in plain.items():
        assert small[rid].outputs[0].token_ids == want.outputs[0].token_ids, rid
        assert small[rid].outputs[0].exit_depths == want.outputs[0].exit_depths, rid


def test_block_hashes_chain_and_cover_full_blocks_only():
    salt = b"model"
    first = block_hashes(salt, [1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(first) == 2  # the ninth token is no full block
    assert block_hashes(salt, [1, 2, 3, 4, 5, 6, 7, 8], 4) == first
    assert block_hashes(salt, [9, 2, 3, 4, 5, 6, 7, 8], 4)[1] != first[1]  # chained
    assert block_hashes(b"other", [1, 2, 3, 4], 4)[0] != first[0]  # salted


def test_shared_blocks_are_counted_and_evicted_least_recent_first():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_caching=True)
    hashes = block_hashes(b"", [1, 2, 3, 4], 2)
    kv.grow("a", 4)
    kv.register("a", 0, hashes[0])
    kv.register("a", 1, hashes[1])
    assert kv.match_prefix("b", hashes) == [
        (0, kv.block_table("a")[0]),
        (1, kv.block_table("a")[1]),
    ]
    kv.free("a")
    assert kv.num_free_blocks == 2  # b still holds both
    kv.free("b")
    assert kv.num_free_blocks == 4 and kv.num_cached_blocks == 2 and kv.all_free()
    kv.grow("c", 6)  # 2 free blocks, then the cached ones: the prompt's last block first
    assert kv.num_cached_blocks == 1 and kv.count_hits(hashes) == 1
    kv.free("c")


def test_caching_can_be_turned_off():
    assert CacheConfig(enable_prefix_caching=False).enable_prefix_caching is False


def test_llm_stats_report_the_prefix_cache():
    from vllm_rlt import LLM

    llm = LLM(model="toy", cache_config=CacheConfig(num_blocks=64, block_size=4))
    params = SamplingParams(max_tokens=2, temperature=0.0)
    llm.generate([PREFIX + [7]], params, use_tqdm=False)
    llm.generate([PREFIX + [8], PREFIX + [9]], params, use_tqdm=False)
    stats = llm.stats()
    assert stats["prefix_cache_queries"] == 3 * (len(PREFIX) + 1)
    assert stats["prefix_cache_hits"] == 2 * 12  # three full blocks of the prefix each
    assert stats["prefix_cache_hit_rate"] == pytest.approx(24 / 42)
    assert stats["num_cached_blocks"] >= 3 and stats["num_free_blocks"] == stats["num_blocks"]


def test_num_cached_tokens_counts_the_prompt_found_in_the_cache(make_engine):
    """vLLM's RequestOutput.num_cached_tokens: the prompt tokens a request's first admission
    took from the prefix cache (whole blocks), 0 without a hit, without caching, or with
    prompt logprobs (which compute every position)."""
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    scored = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)
    for caching, want in ((True, 12), (False, 0)):
        engine = make_engine(enable_prefix_caching=caching, prefill_chunk_size=4)
        arrivals = {  # the others come once the first has ended, its blocks in the cache
            0: [("first", PREFIX + [40], params)],
            40: [("again", PREFIX + [41], params), ("scored", PREFIX + [42], scored)],
        }
        outputs = drain(engine, arrivals)
        counts = {rid: output.num_cached_tokens for rid, output in outputs.items()}
        assert counts == {"first": 0, "again": want, "scored": 0}, caching
