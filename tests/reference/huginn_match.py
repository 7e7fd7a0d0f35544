"""How the Huginn tests compare an engine completion with the oracle's result."""

from __future__ import annotations

import pytest

from tests.reference.huginn_oracle import HuginnModel, HuginnResult, huginn_generate
from vllm_rlt import LLM, SamplingParams

# Prompts of three lengths, each with its own request seed, run batched against the oracle.
PROMPTS = [[5, 17, 42, 101, 7, 250], [9, 3], [200, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
SEEDS = [3, 11, 7]
# Prompts sharing a prefix of two 4-position blocks, for a pool too small for them at once.
SHARED_PREFIX_PROMPTS = [[200, 11, 12, 13, 14, 15, 16, 17, 30 + i] for i in range(3)]


def assert_matches_oracle(completion, want: HuginnResult, prompt_len: int, atol: float) -> None:
    """Same tokens, same exit depths (token i came from position prompt_len - 1 + i), and
    each returned logprob within `atol` of the oracle's."""
    assert completion.token_ids == want.token_ids
    assert completion.exit_depths == want.steps[prompt_len - 1 :]
    for logprobs, logits in zip(completion.logprobs, want.logits, strict=True):
        reference = logits.log_softmax(-1)
        for token, entry in logprobs.items():
            assert entry.logprob == pytest.approx(float(reference[token]), abs=atol)


def check_batch_against_oracle(
    llm: LLM, model: HuginnModel, max_tokens: int, params: dict, oracle: dict
) -> list:
    """PROMPTS batched on `llm` (greedy, SEEDS, 3 logprobs, and `params`) against the oracle
    run one request at a time (`oracle`: huginn_generate's keywords), and no block left in
    use; returns the engine's outputs."""
    requests = [
        SamplingParams(
            max_tokens=max_tokens, temperature=0.0, seed=seed, ignore_eos=True, logprobs=3, **params
        )
        for seed in SEEDS
    ]
    outputs = llm.generate(PROMPTS, requests, use_tqdm=False)
    for prompt, seed, output in zip(PROMPTS, SEEDS, outputs, strict=True):
        want = huginn_generate(model, prompt, max_tokens=max_tokens, seed=seed, **oracle)
        assert_matches_oracle(output.outputs[0], want, len(prompt), atol=1e-4)
    assert llm.engine.all_blocks_free()
    return outputs


def check_preempted_shared_prefix(llm: LLM, model: HuginnModel, seeds: list[int]):
    """Run SHARED_PREFIX_PROMPTS (latent criterion at 0.5, per-request seeds) on `llm`, built
    with 4-position blocks and a pool too small for them at once: the prefix is read from
    the cache, requests are preempted and replay, and tokens and exit depths stay the
    oracle's. Returns the engine's scheduler."""
    params = [
        SamplingParams(max_tokens=10, temperature=0.0, seed=s, ignore_eos=True, exit_threshold=0.5)
        for s in seeds
    ]
    outputs = llm.generate(SHARED_PREFIX_PROMPTS, params, use_tqdm=False)
    scheduler = llm.engine.scheduler
    assert scheduler.num_preemptions > 0
    assert scheduler.prefix_hits > 0
    for prompt, seed, output in zip(SHARED_PREFIX_PROMPTS, seeds, outputs, strict=True):
        want = huginn_generate(
            model,
            prompt,
            max_tokens=10,
            seed=seed,
            lookup="latest",
            exit_criterion="latent-diff",
            exit_threshold=0.5,
        )
        assert output.outputs[0].token_ids == want.token_ids
        assert output.outputs[0].exit_depths == want.steps[len(prompt) - 1 :]
    assert llm.engine.all_blocks_free()
    return scheduler
