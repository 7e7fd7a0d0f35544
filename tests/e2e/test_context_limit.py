"""Every feature at the edge of the context and of the KV pool: prompt + max_tokens equal to
the model length and one below it, with a pool whose last block the request needs. Each
run gives exactly max_tokens tokens, greedy runs equal plain decoding, nothing leaks; and a
pass that fails on the host fails only the requests in it."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import drain
from vllm_rlt import SamplingParams, SpeculativeConfig
from vllm_rlt.config import ExitConfig
from vllm_rlt.models.ouro import OuroConfig, OuroModel

MODEL_LEN = 24
BLOCK = 4


@pytest.fixture(scope="module")
def short_model(toy_config, toy_state) -> OuroModel:
    config = OuroConfig.from_dict({**toy_config, "max_position_embeddings": MODEL_LEN})
    return OuroModel(config, toy_state, torch.float32, "cpu")


def _greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kwargs)


def _sampled(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=7, ignore_eos=True, **kwargs)


# name -> (engine settings, sampling settings, whether the output must equal plain greedy)
FEATURES = {
    "plain": ({}, {}, True),
    "speculation K=4 d=1": ({"spec": (4, 1)}, {}, True),
    "speculation K=1 d=2": ({"spec": (1, 2)}, {}, True),
    "speculation async": ({"spec": (3, 1), "async_scheduling": True}, {}, True),
    "speculation sampled": ({"spec": (3, 1)}, {"sampled": True}, False),
    "speculation with logprobs": ({"spec": (3, 1)}, {"logprobs": 2}, True),
    "async": ({"async_scheduling": True}, {}, True),
    "logprobs": ({}, {"logprobs": 2, "prompt_logprobs": 2}, True),
    "n=2 sampled": ({}, {"sampled": True, "n": 2}, False),
    "penalties": ({}, {"repetition_penalty": 1.3, "logit_bias": {7: 5.0}}, False),
    "adaptive depth": ({"exit": 0.5}, {}, False),
    "no_refill": ({"mode": "no_refill"}, {}, True),
    "shared_decode": ({"layout": "shared_decode"}, {}, False),
    "shared": ({"layout": "shared"}, {}, False),
    "chunked prompt": ({"prefill_chunk_size": 5}, {}, True),
}


def _engine(make_engine, short_model, settings: dict):
    spec = settings.get("spec")
    layout = settings.get("layout", "last_exited")
    return make_engine(
        model=short_model,
        layout=layout,
        # exactly the blocks one request at the model length needs (shared_decode: its
        # prompt also holds one table per loop): it takes the last one
        num_blocks=MODEL_LEN
        // BLOCK
        * (short_model.config.num_loops if layout == "shared_decode" else 1),
        block_size=BLOCK,
        async_scheduling=settings.get("async_scheduling", False),
        enable_prefix_caching=layout != "shared_decode",
        speculative_config=None
        if spec is None
        else SpeculativeConfig(num_speculative_tokens=spec[0], draft_loops=spec[1]),
        exit_config=ExitConfig(),
        mode=settings.get("mode", "refill"),
        prefill_chunk_size=settings.get("prefill_chunk_size", 512),
        max_num_seqs=2,
    )


def _params(settings: dict, max_tokens: int, threshold: float) -> SamplingParams:
    settings = dict(settings)
    make = _sampled if settings.pop("sampled", False) else _greedy
    return make(max_tokens, exit_threshold=threshold, **settings)


@pytest.mark.parametrize("total", [MODEL_LEN - 1, MODEL_LEN], ids=["len-1", "len"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_every_feature_runs_to_the_context_limit(make_engine, short_model, feature, total):
    engine_settings, param_settings, equals_plain = FEATURES[feature]
    threshold = engine_settings.get("exit", 1.0)
    for max_tokens in (1, 2, 7):
        prompt = [3 + (i * 5) % 250 for i in range(total - max_tokens)]
        params = _params(param_settings, max_tokens, threshold)
        engine = _engine(make_engine, short_model, engine_settings)
        # twice: the second run finds the first one's prompt blocks in the prefix cache
        runs = [drain(engine, {0: [(f"r{i}", prompt, params)]})[f"r{i}"] for i in range(2)]
        for out in runs:
            assert out.error is None
            assert [len(c.token_ids) for c in out.outputs] == [max_tokens] * params.n
            assert {c.finish_reason for c in out.outputs} == {"length"}
        if equals_plain:
            plain = _engine(make_engine, short_model, {})
            want = drain(plain, {0: [("p", prompt, _greedy(max_tokens))]})["p"]
            assert [c.token_ids for c in runs[0].outputs] == [want.outputs[0].token_ids]
        if params.n == 1 and param_settings.get("sampled") is None:
            assert runs[0].outputs[0].token_ids == runs[1].outputs[0].token_ids


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_failed_pass_fails_its_requests_and_the_engine_goes_on(
    make_engine, monkeypatch, async_scheduling
):
    """The pass that runs the prompt's last loop (and so registers its blocks in the prefix
    cache) fails: that request ends with the error, and a request with the same prompt,
    queued outside the pass, still gets a clean run's tokens, not the unwritten K/V."""
    prompt = list(range(3, 3 + 8))
    params = _greedy(5)
    clean = drain(make_engine(), {0: [("c", prompt, params)]})["c"]

    engine = make_engine(max_num_seqs=1, async_scheduling=async_scheduling)
    run_pass = engine.runner.run_pass
    passes = []

    def failing_pass(decode, chunks, *args, **kwargs):
        passes.append(chunks)
        if any(c.request_id == "bad" and c.samples for c in chunks):
            raise IndexError("simulated pass failure")
        return run_pass(decode, chunks, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "run_pass", failing_pass)
    outs = drain(engine, {0: [("bad", prompt, params), ("good", prompt, params)]})
    assert "IndexError: simulated pass failure" in outs["bad"].error
    assert outs["bad"].outputs[0].finish_reason == "abort"
    assert outs["good"].error is None
    assert outs["good"].outputs[0].token_ids == clean.outputs[0].token_ids
    assert engine.scheduler.kv.num_cached_blocks == 2  # "good"'s own, registered anew
