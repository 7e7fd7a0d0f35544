"""A checkpoint's generation_config.json sets the sampling a request leaves unset, as vLLM
reads it: the built-in model decodes greedily out of the box, and its chat template renders
the bare prompt it was trained on, so chat answers as generate does."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from vllm_rlt import LLM, SamplingParams
from vllm_rlt.entrypoints.openai.protocol import ChatCompletionRequest
from vllm_rlt.entrypoints.openai.request_jobs import RequestJobs
from vllm_rlt.models.generation_defaults import sampling_defaults


def test_the_keys_vllm_reads_are_taken_and_do_sample_false_is_greedy(tmp_path):
    config = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_length": 9, "min_p": True}
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    assert sampling_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    (tmp_path / "generation_config.json").write_text(json.dumps({**config, "do_sample": False}))
    assert sampling_defaults(tmp_path)["temperature"] == 0.0
    (tmp_path / "generation_config.json").unlink()
    assert sampling_defaults(tmp_path) == {}


def test_a_bad_generation_config_is_an_error_naming_the_file(tmp_path):
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="generation_config.json: must hold a JSON object"):
        sampling_defaults(tmp_path)


class _Engine:
    info = SimpleNamespace(vocab_size=259)
    processor = SimpleNamespace(
        sampling_defaults={"temperature": 0.0, "top_k": 5}, core_params=lambda params: params
    )


def test_a_request_keeps_what_it_sets_and_takes_the_rest_from_the_model():
    serving = RequestJobs.__new__(RequestJobs)
    serving.engine = _Engine()
    base = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    unset = serving._params(ChatCompletionRequest.model_validate(base), 4, None)
    assert (unset.temperature, unset.top_k) == (0.0, 5)
    explicit = ChatCompletionRequest.model_validate({**base, "temperature": 0.8, "top_k": 0})
    params = serving._params(explicit, 4, None)
    assert (params.temperature, params.top_k) == (0.8, 0)


def test_built_in_chat_answers_like_generate():
    llm = LLM()
    assert llm.get_default_sampling_params().temperature == 0.0
    chat = llm.chat([{"role": "user", "content": "347+589="}], use_tqdm=False)
    assert chat[0].outputs[0].text == "936"
    with_system = [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "4821*7="},
    ]
    assert (
        llm.chat(with_system, SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text
        == "33747"
    )
