"""The frontend's output processor: the core's token deltas become outputs in the form the
request asked for (cumulative, delta, final only), with stop strings cut in the frontend
and text that could still become one held back from deltas."""

from __future__ import annotations

import pytest

from vllm_rlt.engine.messages import CompletionDelta, RequestDelta
from vllm_rlt.engine.output_processor import RequestState
from vllm_rlt.models.load import load_tokenizer
from vllm_rlt.sampling_params import RequestOutputKind, SamplingParams

CUMULATIVE, DELTA, FINAL_ONLY = (
    RequestOutputKind.CUMULATIVE,
    RequestOutputKind.DELTA,
    RequestOutputKind.FINAL_ONLY,
)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)  # the built-in model's


def _state(tokenizer, kind=CUMULATIVE, **params) -> RequestState:
    params = SamplingParams(output_kind=kind, **params)
    return RequestState("r", "p", [1, 2], params, tokenizer, arrival_time=0.0)


def _delta(tokens, start, finish=None, index=0, finished=False, logprobs=False) -> RequestDelta:
    part = CompletionDelta(
        index=index,
        start=start,
        token_ids=tokens,
        exit_depths=[4] * len(tokens),
        logprobs=[-0.5] * len(tokens) if logprobs else None,
        top_logprobs=[[(0, -1.0)]] * len(tokens) if logprobs else None,
        finish_reason=finish,
    )
    return RequestDelta("r", [part], finished)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_the_three_output_kinds_carry_the_same_completion(tokenizer):
    ids = _ids(tokenizer, "347+589=936")
    halves = [(ids[:4], 0, None, False), (ids[4:], 4, "length", True)]
    seen = {}
    for kind in (CUMULATIVE, DELTA, FINAL_ONLY):
        state = _state(tokenizer, kind, logprobs=1)
        seen[kind] = []
        for tokens, start, finish, finished in halves:
            state.absorb(_delta(tokens, start, finish, finished=finished, logprobs=True), 1.0)
            seen[kind].append(state.output())
    first, last = seen[CUMULATIVE]
    assert first.outputs[0].token_ids == ids[:4] and not first.finished
    assert last.outputs[0].token_ids == ids and last.outputs[0].text == "347+589=936"
    assert last.outputs[0].cumulative_logprob == pytest.approx(-0.5 * len(ids))
    assert first.outputs[0].token_ids == ids[:4]  # an output the caller kept is not changed
    assert seen[FINAL_ONLY][0] is None and seen[FINAL_ONLY][1].outputs == last.outputs
    deltas = seen[DELTA]
    assert [d.outputs[0].token_ids for d in deltas] == [ids[:4], ids[4:]]
    assert "".join(d.outputs[0].text for d in deltas) == "347+589=936"
    assert [d.outputs[0].finish_reason for d in deltas] == [None, "length"]
    assert sum(len(d.outputs[0].logprobs) for d in deltas) == len(ids)


def test_a_stop_string_cuts_the_completion_and_asks_for_its_abort(tokenizer):
    ids = _ids(tokenizer, "12+34=46\n99")
    stop_at = next(i for i in range(len(ids)) if "\n" in tokenizer.decode(ids[: i + 1]))
    state = _state(tokenizer, stop=["\n"], max_tokens=32)
    assert state.absorb(_delta(ids, 0), 1.0) == [0]  # the caller aborts completion 0
    output = state.output()
    assert output.finished and output.outputs[0].finish_reason == "stop"
    assert output.outputs[0].text == "12+34=46"
    assert output.outputs[0].token_ids == ids[: stop_at + 1]  # tokens after it are dropped
    assert state.absorb(_delta([], len(ids), "abort", finished=True), 2.0) == []
    assert state.output().outputs[0].finish_reason == "stop" and state.engine_done


def test_deltas_hold_back_what_could_still_become_a_stop_string(tokenizer):
    state = _state(tokenizer, DELTA, stop=["###"], max_tokens=32)
    sent = []
    for index, token in enumerate(_ids(tokenizer, "ab#c")):
        state.absorb(_delta([token], index), 1.0)
        output = state.output()
        sent.append(output.outputs[0].text if output and output.outputs else "")
    assert sent == ["", "", "a", "b"]  # the last two characters could start "###"
    state.absorb(_delta([], 4, "length", finished=True), 2.0)
    assert state.output().outputs[0].text == "#c"


def test_min_tokens_delays_stop_strings(tokenizer):
    ids = _ids(tokenizer, "1\n2\n")
    state = _state(tokenizer, stop=["\n"], min_tokens=3, max_tokens=8)
    state.absorb(_delta(ids, 0), 1.0)
    assert state.output().outputs[0].text == "1\n2"


def test_a_delta_waits_for_the_prompt_logprobs_it_asked_for(tokenizer):
    state = _state(tokenizer, DELTA, n=2, prompt_logprobs=1, max_tokens=4)
    state.absorb(_delta(_ids(tokenizer, "1"), 0, index=1), 1.0)
    assert state.output() is None  # completion 1 came first; the prompt's are not in yet
    entries = [None, {2: -0.1}]
    state.absorb(RequestDelta("r", [], False, prompt_logprobs=entries), 2.0)
    output = state.output()
    assert output.prompt_logprobs == entries and [c.index for c in output.outputs] == [1]


def test_a_core_error_fails_the_request_with_its_field(tokenizer):
    state = _state(tokenizer, FINAL_ONLY)
    bad = RequestDelta("r", [], True, error="bad top_k", error_param="top_k", invalid=True)
    state.absorb(bad, 1.0)
    assert state.failure is not None and getattr(state.failure, "param", None) == "top_k"
    assert state.engine_done


def test_output_kind_is_checked():
    with pytest.raises(ValueError, match="output_kind must be one of"):
        SamplingParams(output_kind=7)
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA


def test_offline_outputs_are_timed_after_their_pass(monkeypatch):
    """LLMEngine stamps a step's tokens when the pass that made them is out, and forgets a
    request the core has already let go."""
    import time

    from vllm_rlt import LLM

    llm = LLM(model="toy")
    ends = []
    step = llm.engine.step

    def timed_step():
        deltas = step()
        ends.append(time.monotonic())
        return deltas

    monkeypatch.setattr(llm.engine, "step", timed_step)
    output = llm.generate([[5, 6]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert output.metrics.finished_time >= ends[-1]
    assert output.metrics.first_token_time >= ends[0]
    engine = llm.llm_engine
    engine.add_request("gone", [5, 6], SamplingParams(max_tokens=3))
    llm.engine.abort_request("gone")  # the core forgets it behind the frontend's back
    assert engine.abort_request("gone") is None and not engine.has_unfinished
