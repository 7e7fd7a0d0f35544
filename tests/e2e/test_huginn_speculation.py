"""Self-speculation on a tiny Huginn checkpoint (prelude / recurrent block / coda) against
the serial Huginn oracle, in float32 on the CPU. A drafting lane runs the coda on its state
at the draft depth, and its coda K/V is written again when the token exits; a lane whose
exit comes while its token is a draft waits, and its coda runs from the state it kept once
the token is accepted. Greedy tokens, exit depths and logprobs equal the oracle's at a
fixed depth and under the latent criterion (those that read the logits are refused), with
chunked prompts, preemption and prefix caching; and the shipped Huginn-shaped model
accepts its drafts."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.reference.huginn_match import (
    PROMPTS,
    SEEDS,
    check_batch_against_oracle,
    check_preempted_shared_prefix,
)
from vllm_rlt import LLM, SamplingParams, SpeculativeConfig
from vllm_rlt.config import CacheConfig, ExitConfig, SchedulerConfig
from vllm_rlt.training.data import held_out, training_set
from vllm_rlt.worker.spec_lanes import SpecLanes

MAX_TOKENS = 8


@pytest.fixture
def released(monkeypatch) -> list[int]:
    """Per call of SpecLanes.events (two a pass): held lanes whose token was accepted, so
    that they exit in this pass with the coda run from the state they kept."""
    counts: list[int] = []
    events = SpecLanes.events

    def counting(self, slots, *args):
        result = events(self, slots, *args)
        counts.append(int((result[2] & ~self.drafted[slots]).sum()))
        return result

    monkeypatch.setattr(SpecLanes, "events", counting)
    return counts


def _engine(huginn_folder: Path, draft_loops: int, mode: str = "auto", **options) -> LLM:
    cache = options.pop("cache", {"num_blocks": 96})
    scheduler = {"max_num_seqs": 4, "max_num_batched_tokens": 64, **options}
    return LLM(
        model=str(huginn_folder),
        dtype="float32",
        cache_config=CacheConfig(layout="last_exited", **cache),
        scheduler_config=SchedulerConfig(**scheduler),
        exit_config=ExitConfig(mode=mode),
        speculative_config=SpeculativeConfig(num_speculative_tokens=3, draft_loops=draft_loops),
    )


CASES = [  # (mode, oracle criterion, threshold, min_loops, draft_loops, prompt chunk)
    ("auto", "none", None, 1, 1, None),
    ("auto", "none", None, 1, 3, 4),
    ("auto", "none", None, 1, 6, None),
    ("latent_diff", "latent-diff", 0.9, 1, 2, None),  # exits held and released
    ("latent_diff", "latent-diff", 0.95, 1, 3, 4),  # exits held and released
    ("latent_diff", "latent-diff", 0.9, 2, 1, None),
]


@pytest.mark.parametrize(("mode", "criterion", "threshold", "min_loops", "draft", "chunk"), CASES)
def test_speculation_equals_the_oracle(
    huginn_folder, huginn_oracle, released, mode, criterion, threshold, min_loops, draft, chunk
):
    scheduler = {} if chunk is None else {"prefill_chunk_size": chunk}
    llm = _engine(huginn_folder, draft, mode, **scheduler)
    extra = {} if threshold is None else {"exit_threshold": threshold, "min_loops": min_loops}
    oracle = {"lookup": "latest", "exit_criterion": criterion, "min_steps": min_loops - 1}
    if threshold is not None:
        oracle["exit_threshold"] = threshold
    outputs = check_batch_against_oracle(llm, huginn_oracle, MAX_TOKENS, extra, oracle)
    scheduler = llm.engine.scheduler
    assert scheduler.num_drafted > 0
    if threshold is not None:
        assert len({d for o in outputs for d in o.outputs[0].exit_depths[1:]}) > 1
    if mode == "latent_diff" and min_loops == 1:
        assert max(released) > 0


def test_drafts_of_most_loops_are_accepted_and_save_passes(huginn_folder):
    """Six of eight loops draft what eight give for most tokens: fewer passes."""
    params = SamplingParams(max_tokens=12, temperature=0.0, seed=1, ignore_eos=True)
    plain = LLM(model=str(huginn_folder), dtype="float32", cache_config=CacheConfig(num_blocks=96))
    want = plain.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].token_ids
    llm = _engine(huginn_folder, 6)
    got = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want
    scheduler = llm.engine.scheduler
    assert scheduler.num_accepted > scheduler.num_drafted // 2
    assert llm.engine.passes.num_passes < plain.engine.passes.num_passes


def test_preemption_and_prefix_caching_stay_exact(huginn_folder, huginn_oracle):
    """A pool too small for every request at once preempts speculating requests, which
    replay their tokens (block K/V, initial state and coda recomputed) and speculate again;
    prompts sharing a prefix read it from the cache."""
    cache = {"num_blocks": 14, "block_size": 4, "enable_prefix_caching": True}
    llm = _engine(huginn_folder, 3, "latent_diff", cache=cache, max_num_seqs=3)
    assert check_preempted_shared_prefix(llm, huginn_oracle, SEEDS).num_drafted > 0


def test_sampled_speculation_reproduces_with_a_seed(huginn_folder):
    """Sampled rows with a seed draw the same tokens again alone and in a batch while
    speculating, and the lanes leave no block taken (that the drafts' rejection sampling
    follows the target distribution is test_speculation.py's, on the same lanes)."""
    params = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=4, ignore_eos=True)
    llm = _engine(huginn_folder, 4)
    alone = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].token_ids
    batched = llm.generate(PROMPTS, [params] * 3, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == batched
    assert llm.engine.scheduler.num_drafted > 0
    assert llm.engine.all_blocks_free()


def test_what_speculation_cannot_run_with_is_refused(huginn_folder):
    """Lanes hold a drafted token's exit themselves: sync_passes defaults to 1 with
    speculation, and more is refused by name. Exit rules that read the logits run the
    coda at every check, over the K/V of a token still being computed: refused. So is
    the shared layout, as for every model."""
    llm = _engine(huginn_folder, 2, "latent_diff")
    assert llm.engine.runner.head.sync is None
    with pytest.raises(ValueError, match="sync_passes"):
        LLM(
            model=str(huginn_folder),
            dtype="float32",
            exit_config=ExitConfig(mode="latent_diff", sync_passes=2),
            speculative_config=SpeculativeConfig(num_speculative_tokens=2, draft_loops=2),
        )
    for mode in ("kl", "entropy_diff"):  # their checks run the coda on every loop
        with pytest.raises(ValueError, match="speculative decoding cannot run with exit mode"):
            _engine(huginn_folder, 2, mode)
    with pytest.raises(ValueError, match="last_exited KV layout"):
        LLM(
            model=str(huginn_folder),
            dtype="float32",
            cache_config=CacheConfig(layout="shared"),
            speculative_config=SpeculativeConfig(num_speculative_tokens=2, draft_loops=2),
        )


def test_the_built_in_model_accepts_its_two_loop_drafts():
    """The shipped Huginn-shaped model (8 loops) drafts with 2 what 8 give: the same
    answers, every draft accepted (within rounding), and fewer passes a request."""
    params = SamplingParams(max_tokens=12, temperature=0.0)
    prompts = [prompt for prompt, _ in held_out("add", 4, training_set("add", 40000))]
    plain = LLM(model="huginn-tasks")
    spec = LLM(
        model="huginn-tasks",
        speculative_config=SpeculativeConfig(num_speculative_tokens=3, draft_loops=2),
    )
    for prompt in prompts:  # one at a time: passes count what a request waits
        want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
        assert spec.generate([prompt], params, use_tqdm=False)[0].outputs[0].text == want
    scheduler = spec.engine.scheduler
    assert scheduler.num_accepted >= 0.9 * scheduler.num_drafted > 0
    assert spec.engine.passes.num_passes < 0.8 * plain.engine.passes.num_passes
