"""Engine equals the serial oracle: tokens and exit depths, float32 greedy
(docs/design.md §3, §6)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.conftest import drain
from tests.reference.oracle import reference_dense_logits, reference_generate
from vllm_rlt import ExitConfig, SamplingParams

PROMPT_LENGTHS = (1, 5, 13, 23)
MAX_TOKENS = (9, 6, 11, 7)
ARRIVAL_STEPS = (0, 0, 3, 17)
EOS = frozenset({0, 2})

POLICIES = {
    "ouro_q0.3": ("ouro", 0.3),
    "ouro_q0.7": ("ouro", 0.7),
    "ouro_q1.0": ("ouro", 1.0),
    "ouro_delayed_q0.5": ("ouro_delayed", 0.5),
    "trace": ("trace", 1.0),
}


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 259) for _ in range(n)] for n in PROMPT_LENGTHS]


def _traces() -> dict[str, tuple[int, ...]]:
    rng = random.Random(11)
    return {
        f"r{i}": (4, *(rng.randint(1, 4) for _ in range(MAX_TOKENS[i] - 1)))
        for i in range(len(PROMPT_LENGTHS))
    }


def oracle_outputs(
    toy_config, toy_state, prompts, max_tokens, traces, layout: str, policy: str, **kwargs
) -> list:
    """The oracle's output for each prompt (trace policy: `traces["r{i}"]`)."""
    mode, threshold = POLICIES[policy]
    return [
        reference_generate(
            toy_config,
            toy_state,
            prompt,
            max_tokens=max_tokens[i],
            layout=layout,
            exit_mode=mode,
            exit_threshold=threshold,
            trace=list(traces[f"r{i}"]) if mode == "trace" else None,
            **kwargs,
        )
        for i, prompt in enumerate(prompts)
    ]


_ORACLE_CACHE: dict[tuple[str, str], list] = {}


def _oracle(toy_config, toy_state, layout: str, policy: str) -> list:
    key = (layout, policy)
    if key not in _ORACLE_CACHE:
        _ORACLE_CACHE[key] = oracle_outputs(
            toy_config,
            toy_state,
            _prompts(),
            MAX_TOKENS,
            _traces(),
            layout,
            policy,
            eos_token_ids=EOS,
        )
    return _ORACLE_CACHE[key]


def _run(make_engine, layout, policy, mode, chunk, async_scheduling=False):
    exit_mode, threshold = POLICIES[policy]
    exit_config = ExitConfig(
        mode=exit_mode, depths_by_request=_traces() if exit_mode == "trace" else {}
    )
    engine = make_engine(
        layout=layout,
        exit_config=exit_config,
        mode=mode,
        prefill_chunk_size=chunk,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        async_scheduling=async_scheduling,
    )
    arrivals: dict[int, list] = {}
    for i, prompt in enumerate(_prompts()):
        params = SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0.0, exit_threshold=threshold)
        arrivals.setdefault(ARRIVAL_STEPS[i], []).append((f"r{i}", prompt, params))
    return drain(engine, arrivals)


# SHARED prefill runs one position at a time whatever the chunk size, so one size suffices.
MATRIX = [
    (layout, policy, mode, chunk)
    for layout, chunks in (
        ("last_exited", (1, 4, 64)),
        ("shared", (4,)),
        ("shared_decode", (1, 4, 64)),
    )
    for policy in POLICIES
    for mode in ("refill", "no_refill")
    for chunk in chunks
]


@pytest.mark.parametrize(("layout", "policy", "mode", "chunk"), MATRIX)
def test_engine_matches_oracle(make_engine, toy_config, toy_state, layout, policy, mode, chunk):
    expected = _oracle(toy_config, toy_state, layout, policy)
    outputs = _run(make_engine, layout, policy, mode, chunk)
    for i, reference in enumerate(expected):
        completion = outputs[f"r{i}"].outputs[0]
        assert completion.token_ids == reference.token_ids, f"r{i} tokens"
        assert completion.exit_depths == reference.exit_depths, f"r{i} depths"


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("layout", ["last_exited", "shared", "shared_decode"])
def test_async_scheduling_matches_oracle(make_engine, toy_config, toy_state, layout, policy):
    """Launching pass k+1 before reading pass k changes nothing in the outputs."""
    expected = _oracle(toy_config, toy_state, layout, policy)
    outputs = _run(make_engine, layout, policy, "refill", 4, async_scheduling=True)
    for i, reference in enumerate(expected):
        completion = outputs[f"r{i}"].outputs[0]
        assert completion.token_ids == reference.token_ids, f"r{i} tokens"
        assert completion.exit_depths == reference.exit_depths, f"r{i} depths"


def test_adaptive_policies_really_vary_depth(toy_config, toy_state):
    """The matrix above only means something if exits actually happen early and late."""
    depths = [
        d
        for r in _oracle(toy_config, toy_state, "last_exited", "ouro_q0.7")
        for d in r.exit_depths[1:]
    ]
    assert min(depths) < 4 and len(set(depths)) >= 2


def test_fixed_depth_logprobs_equal_dense_recompute(make_engine, toy_config, toy_state):
    """LAST_EXITED at fixed depth T equals a full forward of the sequence without cache."""
    engine = make_engine(prefill_chunk_size=3)
    prompt = _prompts()[2]
    params = SamplingParams(
        max_tokens=8, temperature=0.0, logprobs=5, exit_threshold=1.0, ignore_eos=True
    )
    completion = drain(engine, {0: [("dense", prompt, params)]})["dense"].outputs[0]
    sequence = prompt + completion.token_ids
    dense = reference_dense_logits(toy_config, toy_state, sequence[:-1]).log_softmax(-1)
    for step, entry in enumerate(completion.logprobs):
        row = dense[len(prompt) - 1 + step]
        for token_id, logprob in entry.items():
            assert logprob.logprob == pytest.approx(float(row[token_id]), abs=1e-4)
        top = torch.topk(row, 5).indices.tolist()
        assert set(top) <= set(entry)


@pytest.mark.parametrize("layout", ["last_exited", "shared", "shared_decode"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_prompt_logprobs_equal_dense_recompute(
    make_engine, toy_config, toy_state, layout, async_scheduling
):
    """Prompt positions run every loop: their logprobs are the final loop's LM head, which
    LAST_EXITED and SHARED_DECODE compute exactly as a dense forward does (SHARED reads
    earlier positions at their last loop, so only position 1's equals it). Chunks of 3, two
    completions, and a second request with the same prompt that would otherwise hit the
    prefix cache (its first completion computes the whole prompt; the second may hit):
    every request gets the whole list, vLLM's shape."""
    engine = make_engine(layout=layout, prefill_chunk_size=3, async_scheduling=async_scheduling)
    prompt = _prompts()[3]
    params = SamplingParams(n=2, max_tokens=3, temperature=0.0, prompt_logprobs=4)
    outputs = drain(engine, {0: [("a", prompt, params)], 9: [("b", prompt, params)]})
    dense = reference_dense_logits(toy_config, toy_state, prompt).log_softmax(-1)
    checked = len(prompt) if layout != "shared" else 2
    for rid in ("a", "b"):
        entries = outputs[rid].prompt_logprobs
        assert entries is not None and len(entries) == len(prompt) and entries[0] is None
        for position in range(1, checked):
            row, entry = dense[position - 1], entries[position]
            assert prompt[position] in entry and len(entry) in (4, 5)
            for token_id, logprob in entry.items():
                assert logprob.logprob == pytest.approx(float(row[token_id]), abs=1e-4)
            value = float(row[prompt[position]])  # its rank among all tokens, near ties aside
            rank = entry[prompt[position]].rank
            assert int((row > value + 1e-4).sum()) < rank <= int((row >= value - 1e-4).sum())
            assert set(torch.topk(row, 4).indices.tolist()) <= set(entry)


def test_prompt_logprobs_cost_nothing_when_not_asked(make_engine):
    """Without prompt_logprobs no chunk carries targets, so the LM head runs on no prompt
    row but each prompt's last."""
    engine = make_engine(prefill_chunk_size=4)
    seen = []
    schedule = engine.scheduler.schedule

    def recording():
        out = schedule()
        seen.extend(chunk.prompt_targets for chunk in out.prefill_chunks)
        return out

    engine.scheduler.schedule = recording
    outputs = drain(engine, {0: [("r", _prompts()[3], SamplingParams(max_tokens=2))]})
    assert seen and not any(seen) and outputs["r"].prompt_logprobs is None
