"""One request's failure stays its own (offline API), errors name their field, and stop
strings can be kept in the output."""

from __future__ import annotations

import pytest

from vllm_rlt import LLM, SamplingParams
from vllm_rlt.config import ParamError


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="toy")


def test_a_failed_admission_fails_that_request_and_frees_everything(llm, monkeypatch):
    engine = llm.engine
    state = engine.runner.state
    admit = state.admit_extras

    def failing_admit(new):
        if new.sampling.seed == 777:
            raise OverflowError("simulated slot write failure")
        admit(new)

    monkeypatch.setattr(state, "admit_extras", failing_admit)
    params = [SamplingParams(max_tokens=5, seed=seed) for seed in (1, 777, 2)]
    with pytest.raises(RuntimeError, match="simulated slot write failure"):
        llm.generate(["a", "b", "c"], params, use_tqdm=False)
    assert not engine.has_unfinished and engine.all_blocks_free()
    monkeypatch.setattr(state, "admit_extras", admit)
    outputs = llm.generate(["a", "b"], SamplingParams(max_tokens=3, ignore_eos=True))
    assert [o.outputs[0].finish_reason for o in outputs] == ["length", "length"]
    assert engine.all_blocks_free()


def test_a_request_the_frontend_cannot_process_fails_alone(llm, monkeypatch):
    """A failure while turning one request's tokens into output ends that request with its
    error (in the core too); a request beside it in the same passes finishes normally."""
    from vllm_rlt.engine.output_processor import RequestState

    absorb = RequestState._absorb_completion

    def failing_absorb(self, part):
        if self.request_id.startswith("bad"):
            raise RuntimeError("simulated output failure")
        return absorb(self, part)

    monkeypatch.setattr(RequestState, "_absorb_completion", failing_absorb)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=4, ignore_eos=True, n=2)
    engine.add_request("bad", [5, 6], params)
    engine.add_request("good", [5, 6], params)
    finals = {}
    while engine.has_unfinished:
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
    assert "simulated output failure" in finals["bad"].error
    assert [c.finish_reason for c in finals["bad"].outputs] == ["abort", "abort"]
    assert finals["good"].error is None
    assert [len(c.token_ids) for c in finals["good"].outputs] == [4, 4]
    assert llm.engine.all_blocks_free() and not llm.engine.has_unfinished


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"top_k": 2**63}, "top_k"),
        ({"seed": -(2**63) - 1}, "seed"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"temperature": float("nan")}, "temperature"),
        ({"min_loops": 3, "max_loops": 2}, "min_loops"),
        ({"max_tokens": 5, "min_tokens": 6}, "min_tokens"),
    ],
)
def test_sampling_errors_name_their_field(kwargs, param):
    with pytest.raises(ParamError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_engine_errors_name_their_field(llm):
    cases = [
        ([2**64], SamplingParams(), "prompt"),
        ([5], SamplingParams(max_loops=9), "max_loops"),
        ([5], SamplingParams(max_tokens=10**9), "max_tokens"),
        ([5], SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
    ]
    for prompt, params, param in cases:
        with pytest.raises(ParamError) as info:
            llm.engine.check_request("x", prompt, params)
        assert info.value.param == param


def test_text_with_a_lone_surrogate_is_a_clear_error(llm):
    with pytest.raises(ParamError, match="lone surrogate"):
        llm.generate("ab\ud800", use_tqdm=False)
    assert llm.engine.all_blocks_free()


def test_include_stop_str_in_output(llm):
    base = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    text = llm.generate("The quick brown fox", base)[0].outputs[0].text
    start = next(i for i in range(2, len(text) - 2) if text[i : i + 2].isprintable())
    stop = text[start : start + 2]
    hit = text.find(stop)
    for include, expected in ((False, text[:hit]), (True, text[: hit + 2])):
        params = SamplingParams(
            max_tokens=16,
            temperature=0.0,
            ignore_eos=True,
            stop=[stop, "never"],
            include_stop_str_in_output=include,
        )
        completion = llm.generate("The quick brown fox", params)[0].outputs[0]
        assert completion.text == expected and completion.finish_reason == "stop"
