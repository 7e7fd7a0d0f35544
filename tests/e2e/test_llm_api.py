"""The offline `LLM` API on the built-in toy: prompt forms, chat, output fields, dtypes and
exit policies. Every test must leave the engine with all blocks and slots free."""

from __future__ import annotations

import pytest
import torch

from vllm_rlt import (
    LLM,
    CacheConfig,
    ExecutionConfig,
    ExitConfig,
    SamplingParams,
    SchedulerConfig,
)
from vllm_rlt.outputs import CompletionOutput, RequestOutput

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
IM_START_ID = 1


def _tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_prompt_forms(llm):
    """Every accepted prompt form gives one output per prompt, in input order."""
    texts = ["hi", "a longer prompt"]
    ids = [llm.tokenizer.encode(t) for t in texts]
    reference = _tokens(llm.generate(texts, GREEDY, use_tqdm=False))
    assert reference[0] != reference[1]

    single = llm.generate("hi", GREEDY, use_tqdm=False)
    assert len(single) == 1 and single[0].prompt == "hi"
    assert single[0].prompt_token_ids == ids[0] == [107, 108]
    assert _tokens(single) == reference[:1]

    one_id_list = llm.generate(ids[1], GREEDY, use_tqdm=False)
    assert len(one_id_list) == 1 and one_id_list[0].prompt is None
    assert one_id_list[0].prompt_token_ids == ids[1]
    assert _tokens(one_id_list) == reference[1:]

    for form in (ids, [{"prompt_token_ids": i} for i in ids]):
        outputs = llm.generate(form, GREEDY, use_tqdm=False)
        assert [o.prompt_token_ids for o in outputs] == ids
        assert [o.prompt for o in outputs] == [None, None]
        assert _tokens(outputs) == reference

    single_dict = llm.generate({"prompt_token_ids": ids[0]}, GREEDY, use_tqdm=False)
    assert _tokens(single_dict) == reference[:1]


def test_outputs_in_input_order_and_request_ids(llm):
    """The first prompt finishes last, yet comes back first; request ids are distinct."""
    params = [
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=4, temperature=0.5, seed=1, ignore_eos=True),
    ]
    prompts = ["first", "second", "third"]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt for o in outputs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outputs] == [7, 2, 4]
    assert len({o.request_id for o in outputs}) == 3
    assert all(isinstance(o.request_id, str) and o.request_id for o in outputs)
    custom = llm.generate(["x", "y"], GREEDY, use_tqdm=False, request_ids=["a", "b"])
    assert [o.request_id for o in custom] == ["a", "b"]


def test_sampling_params_list_must_match_prompts(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [GREEDY], use_tqdm=False)


def test_chat_one_and_many_conversations(llm):
    conversation = [{"role": "user", "content": "hi"}]
    other = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
    ]
    single = llm.chat(conversation, GREEDY, use_tqdm=False)
    assert len(single) == 1
    ids = single[0].prompt_token_ids
    assert ids[0] == IM_START_ID
    assert ids[-1] == ord("\n") + 3  # "...<|im_start|>assistant\n": generation prompt added
    assert ids.count(IM_START_ID) == 2  # the specials are single ids, not their bytes
    assert single[0].prompt == llm.tokenizer.apply_chat_template(conversation)
    many = llm.chat([conversation, other], GREEDY, use_tqdm=False)
    assert len(many) == 2
    assert many[0].prompt_token_ids == ids
    assert _tokens(many)[0] == _tokens(single)[0]
    assert many[1].prompt_token_ids[0] == IM_START_ID
    assert many[1].prompt_token_ids.count(IM_START_ID) == 3


def test_output_fields(llm):
    params = SamplingParams(
        n=2, max_tokens=5, temperature=0.9, seed=11, logprobs=2, exit_threshold=0.5
    )
    (output,) = llm.generate("fields", params, use_tqdm=False)
    assert isinstance(output, RequestOutput) and output.finished
    assert [c.index for c in output.outputs] == [0, 1]
    for completion in output.outputs:
        assert isinstance(completion, CompletionOutput)
        assert completion.finished() and completion.finish_reason in ("stop", "length")
        count = len(completion.token_ids)
        assert 1 <= count <= 5
        if completion.finish_reason == "length":
            assert count == 5
        assert isinstance(completion.text, str)
        assert len(completion.exit_depths) == len(completion.logprobs) == count
        assert completion.exit_depths[0] == 4
        assert all(len(entry) in (2, 3) for entry in completion.logprobs)
    metrics = output.metrics
    assert metrics.time_to_first_token is not None and metrics.time_to_first_token >= 0
    assert metrics.first_token_time >= metrics.arrival_time
    assert metrics.finished_time >= metrics.first_token_time
    assert 1.0 <= metrics.mean_loops_per_token <= 4.0
    decode_depths = [d for c in output.outputs for d in c.exit_depths[1:]]
    assert metrics.mean_loops_per_token == pytest.approx(sum(decode_depths) / len(decode_depths))


def test_all_configs_from_the_package(llm):
    """Every public config is accepted by LLM and takes effect."""
    custom = LLM(
        model="toy",
        cache_config=CacheConfig(layout="shared", block_size=8, num_blocks=20),
        scheduler_config=SchedulerConfig(
            mode="no_refill", max_num_seqs=2, max_num_batched_tokens=8, prefill_chunk_size=2
        ),
        exit_config=ExitConfig(mode="ouro"),
        execution_config=ExecutionConfig(seed=5),
    )
    assert custom.engine.memory_plan.num_blocks == 20 and custom.engine.kv.block_size == 8
    params = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)  # unseeded
    outputs = custom.generate(["a", "bb", "ccc"], params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 3, 3]
    assert custom.engine.all_blocks_free()
    # The engine seed makes unseeded requests reproducible from one LLM to the next.
    again = LLM(
        model="toy",
        cache_config=CacheConfig(layout="shared", block_size=8, num_blocks=20),
        execution_config=ExecutionConfig(seed=5),
    )
    assert _tokens(again.generate(["a", "bb", "ccc"], params, use_tqdm=False)) == _tokens(outputs)


def test_bfloat16_on_cpu():
    llm = LLM(model="toy", dtype="bfloat16")
    assert llm.engine.model.dtype == torch.bfloat16
    (output,) = llm.generate("bf16", GREEDY, use_tqdm=False)
    completion = output.outputs[0]
    assert len(completion.token_ids) == 4 and completion.exit_depths == [4, 4, 4, 4]
    assert all(0 <= t < 259 for t in completion.token_ids)
    assert llm.engine.all_blocks_free()


def _depths(exit_config: ExitConfig, **params) -> list[list[int]]:
    llm = LLM(model="toy", exit_config=exit_config)
    sampling = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, **params)
    outputs = llm.generate(["hello", "abc"], sampling, use_tqdm=False)
    assert llm.engine.all_blocks_free()
    return [o.outputs[0].exit_depths for o in outputs]


def test_random_lookahead_exits_no_earlier_than_loop_two():
    """ "Exit after one more loop": depth 2 at the earliest, reproducible for one seed."""
    first = _depths(ExitConfig(mode="random_lookahead", seed=7), exit_threshold=0.5)
    decode = [d for depths in first for d in depths[1:]]
    assert min(decode) == 2 and max(decode) == 4  # early exits and full-depth tokens both
    assert _depths(ExitConfig(mode="random_lookahead", seed=7), exit_threshold=0.5) == first
    capped = _depths(ExitConfig(mode="random_lookahead", seed=7), exit_threshold=0.5, max_loops=2)
    assert all(d == 2 for depths in capped for d in depths[1:])
    fixed = _depths(ExitConfig(mode="random_lookahead", seed=7), exit_threshold=1.0)
    assert all(d == 4 for depths in fixed for d in depths)


def test_ouro_delayed_exits_one_loop_after_the_trigger():
    """On the first decode token both policies see the same states, so the delayed exit
    comes exactly one loop after the immediate one (capped at T)."""
    immediate = _depths(ExitConfig(mode="ouro"), exit_threshold=0.5)
    delayed = _depths(ExitConfig(mode="ouro_delayed"), exit_threshold=0.5)
    assert any(depths[1] < 4 for depths in immediate)
    for now, later in zip(immediate, delayed, strict=True):
        assert later[0] == 4 and later[1] == min(now[1] + 1, 4)
        assert all(2 <= d <= 4 for d in later[1:])


@pytest.mark.parametrize("order", [("x", "x#0"), ("x#0", "x")])
def test_child_request_ids_do_not_collide_with_user_ids(order):
    """A request with n=2 and id "x" (completions "x#0", "x#1") and a user request "x#0", in
    either order: both run, or the later one is refused up front and the engine stays usable."""
    llm = LLM(model="toy")  # not the shared one: a failure here may leave this engine broken
    pair = SamplingParams(n=2, max_tokens=3, temperature=0.0)
    params = [pair if request_id == "x" else GREEDY for request_id in order]
    try:
        outputs = llm.generate(["a", "b"], params, use_tqdm=False, request_ids=list(order))
    except ValueError as exc:
        assert "already in use" in str(exc)
    else:
        assert [o.request_id for o in outputs] == list(order)
        assert [len(o.outputs) for o in outputs] == [p.n for p in params]
    assert llm.engine.all_blocks_free() and not llm.engine.has_unfinished
    reference = _tokens(LLM(model="toy").generate("b", GREEDY, use_tqdm=False))
    assert _tokens(llm.generate("b", GREEDY, use_tqdm=False)) == reference
