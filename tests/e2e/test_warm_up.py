"""The start-up warm-up of prompt passes (run on CUDA before any request) leaves no trace:
the engine answers exactly as one that never ran it."""

from __future__ import annotations

import torch

from tests.conftest import drain
from vllm_rlt import SamplingParams


def _answers(engine):
    arrivals = {
        0: [("greedy", [5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0))],
        1: [("sampled", [8] * 9, SamplingParams(max_tokens=6, seed=3, ignore_eos=True))],
    }
    finals = drain(engine, arrivals)
    assert engine.all_blocks_free()
    return {rid: out.outputs[0].token_ids for rid, out in finals.items()}


def test_prompt_pass_warm_up_changes_nothing(make_engine):
    plain = _answers(make_engine())
    engine = make_engine()
    state = engine.runner.state
    before = {name: value.clone() for name, value in vars(state).items() if torch.is_tensor(value)}
    # one row, several chunks of the longest prompt, and a short remainder
    engine.runner.warm_up_prompt_passes([1, 2 * engine.max_model_len + 3])
    dummy = engine.runner.dummy_slot  # scratch for padding rows, like a graph's
    for name, value in before.items():
        after = getattr(state, name)
        if value.shape[:1] == (dummy + 1,):
            after, value = after[:dummy], value[:dummy]
        assert torch.equal(after, value), name
    assert not engine.runner.prefill_hidden
    assert _answers(engine) == plain
