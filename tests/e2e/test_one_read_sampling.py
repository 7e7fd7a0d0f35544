"""Rows that filter nothing and ask no top logprobs sample from the LM head's output as it
is, with the min_tokens ban read beside it (pass_head's `_sample_in_one_read`): the same
tokens, logprobs and ranks as the path that writes a widened, masked copy."""

from __future__ import annotations

from tests.conftest import drain
from vllm_rlt import SamplingParams
from vllm_rlt.worker.pass_head import PassHead

PROMPT = [40, 71, 12, 200, 9]


def _requests(stop: int, logprobs: int) -> dict[int, list]:
    """A greedy and a sampled request, each banned from `stop` for its first 4 tokens."""
    common = {"max_tokens": 8, "min_tokens": 4, "stop_token_ids": [stop], "logprobs": logprobs}
    return {
        0: [
            ("greedy", PROMPT, SamplingParams(temperature=0.0, **common)),
            ("sampled", [7, 8, 9], SamplingParams(temperature=1.0, seed=5, **common)),
        ]
    }


def _sampled(outputs, name: str) -> list[tuple[int, float, int]]:
    """(token, its logprob, its rank) of each token `name` generated."""
    completion = outputs[name].outputs[0]
    return [
        (t, entry[t].logprob, entry[t].rank)
        for t, entry in zip(completion.token_ids, completion.logprobs, strict=True)
    ]


def test_the_one_read_path_draws_what_the_masked_copy_draws(make_engine, monkeypatch):
    free = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    greedy = drain(make_engine(), {0: [("free", PROMPT, free)]})["free"].outputs[0].token_ids
    stop = greedy[1]  # what greedy draws second, unbanned
    paths = []

    def counted(name: str):
        method = getattr(PassHead, name)

        def call(*args, **kwargs):
            paths.append(name)
            return method(*args, **kwargs)

        return call

    for name in ("_logits", "_sample_in_one_read"):
        monkeypatch.setattr(PassHead, name, counted(name))
    one_read = drain(make_engine(), _requests(stop, logprobs=0))
    assert set(paths) == {"_sample_in_one_read"}  # no top logprobs: no masked copy
    paths.clear()
    copied = drain(make_engine(), _requests(stop, logprobs=2))
    assert "_logits" in paths  # top logprobs asked: the widened, masked copy
    for name in ("greedy", "sampled"):
        assert _sampled(one_read, name) == _sampled(copied, name)
        assert stop not in one_read[name].outputs[0].token_ids[:4]  # the ban held
    assert one_read["greedy"].outputs[0].token_ids[1] != stop  # and it changed a token
