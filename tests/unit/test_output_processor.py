"""The frontend's output processor: the core's token deltas become outputs in the form the
request asked for (cumulative, delta, final only), with stop strings cut in the frontend,
text that could still become one held back from deltas, the stopping EOS or stop id left
out of the text, and logprobs as vLLM's Logprob objects."""

from __future__ import annotations

import pytest

from vllm_rlt.engine.core_outputs import CompletionDelta, RequestDelta
from vllm_rlt.engine.output_processor import RequestState
from vllm_rlt.logprobs import Logprob
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


def _state(tokenizer, kind=CUMULATIVE, prompt=(1, 2), **params) -> RequestState:
    params = SamplingParams(output_kind=kind, **params)
    return RequestState("r", "p", list(prompt), params, tokenizer, arrival_time=0.0)


def _delta(
    tokens, start, finish=None, index=0, finished=False, logprobs=False, stop_token=None
) -> RequestDelta:
    part = CompletionDelta(
        index=index,
        start=start,
        token_ids=tokens,
        exit_depths=[4] * len(tokens),
        logprobs=[-0.5] * len(tokens) if logprobs else None,
        top_logprobs=[[(0, -1.0)]] * len(tokens) if logprobs else None,
        finish_reason=finish,
        ranks=[2] * len(tokens) if logprobs else None,
        stop_token=stop_token,
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
    state.absorb(RequestDelta("r", [], False, prompt_logprobs=[(-0.1, 1, [])]), 2.0)
    output = state.output()
    assert output.prompt_logprobs == [None, {2: Logprob(-0.1, 1, "<|im_end|>")}]
    assert [c.index for c in output.outputs] == [1]


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


@pytest.mark.parametrize("include_stop", [False, True])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("end", ["eos", "stop id"])
def test_the_stopping_token_stays_in_token_ids_and_out_of_the_text(
    tokenizer, include_stop, skip_special_tokens, end
):
    """vLLM V1: the EOS or stop id that ended a completion is one of its token ids, and in
    its text only with include_stop_str_in_output; stop_reason is the stop id, None for
    EOS."""
    eos = tokenizer.encode("<|endoftext|>", add_special_tokens=False)
    stopper, stop_token = (eos, None) if end == "eos" else (_ids(tokenizer, "9"), 12)
    ids = _ids(tokenizer, "347+589=93") + stopper
    params = dict(
        include_stop_str_in_output=include_stop,
        skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=False,
    )
    for kind in (CUMULATIVE, DELTA):
        state = _state(tokenizer, kind, _ids(tokenizer, "Q:"), max_tokens=32, **params)
        outputs = []
        for index, token in enumerate(ids):
            last = index == len(ids) - 1
            part = _delta([token], index, "stop" if last else None, finished=last)
            part.completions[0].stop_token = stop_token if last else None
            state.absorb(part, 1.0)
            outputs.append(state.output())
        final = outputs[-1].outputs[0]
        text = final.text if kind == CUMULATIVE else "".join(o.outputs[0].text for o in outputs)
        kept = {"eos": "" if skip_special_tokens else "<|endoftext|>", "stop id": "9"}[end]
        assert text == "347+589=93" + (kept if include_stop else "")
        assert final.finish_reason == "stop" and final.stop_reason == stop_token
        assert final.finished() and not outputs[0].outputs[0].finished()
        if kind == CUMULATIVE:
            assert final.token_ids == ids


def test_a_stop_string_is_the_stop_reason(tokenizer):
    state = _state(tokenizer, stop=["+5", "="], include_stop_str_in_output=True, max_tokens=32)
    state.absorb(_delta(_ids(tokenizer, "347+589=936"), 0), 1.0)
    completion = state.output().outputs[0]
    assert completion.text == "347+5" and completion.stop_reason == "+5"
    length = _state(tokenizer, max_tokens=2)
    length.absorb(_delta(_ids(tokenizer, "34"), 0, "length", finished=True), 1.0)
    assert length.output().outputs[0].stop_reason is None


def test_logprobs_are_vllm_logprobs_with_ranks_and_token_texts(tokenizer):
    """The sampled token's entry first (its rank among all tokens), then the top
    alternatives ranked from 1; decoded_token is the token's text, None without a
    tokenizer."""
    ids = _ids(tokenizer, "7+")
    for tok in (tokenizer, None):
        state = _state(tok, logprobs=1, max_tokens=4)
        state.absorb(_delta(ids, 0, logprobs=True), 1.0)
        entries = state.output().outputs[0].logprobs
        texts = ["7", "+"] if tok is not None else [None, None]
        assert entries == [
            {token: Logprob(-0.5, 2, text), 0: Logprob(-1.0, 1, tok and "<|endoftext|>")}
            for token, text in zip(ids, texts, strict=True)
        ]
        assert [next(iter(entry)) for entry in entries] == ids


def test_num_cached_tokens_is_the_first_reported(tokenizer):
    state = _state(tokenizer, max_tokens=4)
    assert state.output().num_cached_tokens == 0  # not admitted yet
    for cached in (32, 0):  # a decode core's import reports its own count later
        delta = _delta(_ids(tokenizer, "1"), state.completions[0].sent_tokens)
        delta.num_cached_tokens = cached
        state.absorb(delta, 1.0)
    assert state.output().num_cached_tokens == 32
