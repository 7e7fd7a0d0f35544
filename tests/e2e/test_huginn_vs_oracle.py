"""The engine on a tiny Huginn checkpoint (prelude / recurrent block / coda) against the
serial Huginn oracle, in float32 on the CPU: greedy tokens, logprobs and exit depths at a
fixed depth in every layout, with per-token depths, under each exit criterion, batched with
chunked prompts, and the seeded initial state."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.reference.huginn_checkpoint import TINY_HUGINN_SEED, write_tiny_huginn
from tests.reference.huginn_match import (
    PROMPTS,
    SEEDS,
    check_batch_against_oracle,
    check_preempted_shared_prefix,
)
from tests.reference.huginn_oracle import HuginnModel, huginn_generate
from vllm_rlt import LLM, SamplingParams
from vllm_rlt.config import AUTO_SYNC_PASSES, CacheConfig, ExitConfig, SchedulerConfig
from vllm_rlt.worker.exit_sync import ExitSync

STEPS = 8  # the tiny checkpoint's mean_recurrence
MAX_TOKENS = 6
LOOKUPS = {"last_exited": "latest", "shared": "final"}


def _engine(
    huginn_folder: Path,
    layout: str = "last_exited",
    mode: str = "auto",
    cache: dict | None = None,
    sync_passes: int = 1,
    **scheduler,
) -> LLM:
    return LLM(
        model=str(huginn_folder),
        dtype="float32",
        cache_config=CacheConfig(layout=layout, **(cache or {"num_blocks": 96})),
        scheduler_config=SchedulerConfig(**scheduler) if scheduler else None,
        exit_config=ExitConfig(mode=mode, sync_passes=sync_passes),
    )


@pytest.fixture
def held_rows(monkeypatch) -> list[int]:
    """How many decode rows each pass held back from exiting (ExitSync.store's count)."""
    counts: list[int] = []
    store = ExitSync.store

    def counting(self, slots, held_back):
        counts.append(int(held_back.sum()))
        store(self, slots, held_back)

    monkeypatch.setattr(ExitSync, "store", counting)
    return counts


def _check(llm: LLM, huginn_oracle: HuginnModel, lookup: str, params: dict, oracle: dict):
    """Every prompt, batched, against the oracle run one request at a time."""
    oracle = {"lookup": lookup, **oracle}
    return check_batch_against_oracle(llm, huginn_oracle, MAX_TOKENS, params, oracle)


@pytest.mark.parametrize("layout", list(LOOKUPS))
@pytest.mark.parametrize("chunk", [None, 4], ids=["whole", "chunked"])
def test_fixed_depth_equals_the_oracle(huginn_folder, huginn_oracle, layout, chunk):
    scheduler = {} if chunk is None else {"max_num_batched_tokens": chunk}
    llm = _engine(huginn_folder, layout, **scheduler)
    outputs = _check(llm, huginn_oracle, LOOKUPS[layout], {}, {})
    assert all(d == STEPS for o in outputs for d in o.outputs[0].exit_depths)


def test_per_request_depth_reads_earlier_tokens_at_their_exit_step(huginn_folder, huginn_oracle):
    """max_loops below the model's depth: prompts still run every loop, decode tokens
    fewer, and later tokens read them at min(step, exit step) (Huginn's latest lookup)."""
    llm = _engine(huginn_folder)
    depth = 3
    _check(llm, huginn_oracle, "latest", {"max_loops": depth}, {"decode_steps": [depth] * 5})


@pytest.mark.parametrize(
    ("mode", "criterion", "threshold", "min_loops"),
    [("latent_diff", "latent-diff", 0.5, 1), ("latent_diff", "latent-diff", 0.9, 3)]
    + [("kl", "kl", 0.05, 1), ("kl", "kl", 0.2, 2)]
    + [("entropy_diff", "entropy-diff", 0.05, 1), ("entropy_diff", "entropy-diff", 0.02, 2)],
)
def test_exit_criteria_equal_the_oracle(
    huginn_folder, huginn_oracle, mode, criterion, threshold, min_loops
):
    llm = _engine(huginn_folder, mode=mode)
    outputs = _check(
        llm,
        huginn_oracle,
        "latest",
        {"exit_threshold": threshold, "min_loops": min_loops},
        {"exit_criterion": criterion, "exit_threshold": threshold, "min_steps": min_loops - 1},
    )
    depths = {d for o in outputs for d in o.outputs[0].exit_depths[1:]}
    assert len(depths) > 1, f"{criterion} at {threshold} never varied the depth: {depths}"


@pytest.mark.parametrize("chunk", [None, 4], ids=["whole", "chunked"])
@pytest.mark.parametrize("sync_passes", [None, 3, 8])
def test_exits_held_back_together_change_nothing(
    huginn_folder, huginn_oracle, held_rows, chunk, sync_passes
):
    """With sync_passes (None: the default, AUTO_SYNC_PASSES under latent_diff), a row
    whose criterion says exit waits, frozen, for the others (worker/exit_sync.py): tokens,
    logprobs and exit depths stay the oracle's, beside prompt chunks too, and rows were
    held back."""
    scheduler = {} if chunk is None else {"max_num_batched_tokens": chunk}
    llm = _engine(huginn_folder, mode="latent_diff", sync_passes=sync_passes, **scheduler)
    assert llm.engine.runner.head.sync.passes == (sync_passes or AUTO_SYNC_PASSES)
    outputs = _check(
        llm,
        huginn_oracle,
        "latest",
        {"exit_threshold": 0.5, "min_loops": 1},
        {"exit_criterion": "latent-diff", "exit_threshold": 0.5, "min_steps": 0},
    )
    assert max(held_rows) > 0
    assert len({d for o in outputs for d in o.outputs[0].exit_depths[1:]}) > 1


def test_exit_sync_is_refused_where_it_saves_nothing(huginn_folder, make_engine):
    """Not held by default, and more than 1 refused by name: under kl, which reads every
    row's logits every loop, and for Ouro, which has no layers after the loop."""
    assert _engine(huginn_folder, mode="kl", sync_passes=None).engine.runner.head.sync is None
    assert make_engine(exit_config=ExitConfig()).runner.head.sync is None
    with pytest.raises(ValueError, match="sync_passes"):
        _engine(huginn_folder, mode="kl", sync_passes=2)
    with pytest.raises(ValueError, match="sync_passes"):
        make_engine(exit_config=ExitConfig(sync_passes=2))  # Ouro: no layers after the loop
    with pytest.raises(ValueError, match="sync_passes"):
        ExitConfig(sync_passes=0)


@pytest.mark.parametrize("sync_passes", [1, 4])
def test_prefix_caching_and_preemption_change_nothing(huginn_folder, huginn_oracle, sync_passes):
    """Prompts sharing a prefix of full blocks read it from the cache, and a pool too small
    for every request at once preempts and replays (each replayed token through its own
    exit step: K/V, initial state and coda all recomputed), at per-token depths, with and
    without exits held back."""
    cache = {"num_blocks": 12, "block_size": 4, "enable_prefix_caching": True}
    llm = _engine(
        huginn_folder, mode="latent_diff", cache=cache, sync_passes=sync_passes, max_num_seqs=3
    )
    check_preempted_shared_prefix(llm, huginn_oracle, SEEDS)


def test_a_seed_reproduces_and_init_scale_zero_ignores_it(huginn_folder, tmp_path):
    llm = _engine(huginn_folder)
    params = [
        SamplingParams(max_tokens=8, temperature=0.0, seed=s, ignore_eos=True) for s in (1, 1, 2)
    ]
    a, b, c = (
        o.outputs[0].token_ids for o in llm.generate([PROMPTS[0]] * 3, params, use_tqdm=False)
    )
    assert a == b and a != c
    write_tiny_huginn(tmp_path, seed=TINY_HUGINN_SEED, overrides={"init_scale": 0.0})
    zero = _engine(tmp_path)
    a, b, c = (
        o.outputs[0].token_ids for o in zero.generate([PROMPTS[0]] * 3, params, use_tqdm=False)
    )
    assert a == b == c
    oracle = huginn_generate(
        HuginnModel.from_folder(tmp_path), PROMPTS[0], max_tokens=8, init_scale=0.0
    )
    assert a == oracle.token_ids


def test_unsupported_features_are_refused_by_name(huginn_folder):
    with pytest.raises(ValueError, match="quantization"):
        LLM(model=str(huginn_folder), dtype="float32", quantization="fp8")
    with pytest.raises(ValueError, match="exit gate"):
        _engine(huginn_folder, mode="ouro")
    with pytest.raises(ValueError, match="kv_layout|layout"):
        _engine(huginn_folder, layout="shared_decode")
    assert torch.get_num_threads() >= 1


def test_the_naive_baseline_equals_the_oracle(huginn_folder, huginn_oracle):
    """`bench throughput`'s eager baseline for this family (bench/naive.py) computes what
    the modeling code does: its greedy tokens at a fixed depth, per request seed."""
    from vllm_rlt.bench.naive import NaiveHuginn, naive_baseline
    from vllm_rlt.models.load import load_model

    model = load_model(huginn_folder, torch.float32, torch.device("cpu"))
    prompts, seeds, depth = [PROMPTS[0], PROMPTS[2][:6]], [3, 11], 5
    naive = naive_baseline(model, len(prompts), len(prompts[0]) + MAX_TOKENS)
    assert isinstance(naive, NaiveHuginn)
    naive.seeds = torch.tensor(seeds)
    naive.generate(torch.tensor(prompts), MAX_TOKENS, depth)
    for row, (prompt, seed) in enumerate(zip(prompts, seeds, strict=True)):
        decode = [depth] * (MAX_TOKENS - 1)
        want = huginn_generate(
            huginn_oracle, prompt, max_tokens=MAX_TOKENS, seed=seed, decode_steps=decode
        )
        assert naive.generated[row].tolist() == want.token_ids
