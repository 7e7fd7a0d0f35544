"""A vLLM V1 offline rollout-and-evaluation script, as RL and evaluation code writes it,
runs with only its import changed: the tokenizer's HF attributes, prompt TypedDicts,
vLLM's sampling arguments, Logprob objects, stop-token text and stop_reason, finished(),
num_cached_tokens, chat template arguments, and a weight update tagged with a version."""

from __future__ import annotations

from vllm_rlt import LLM, SamplingParams  # was: from vllm import LLM, SamplingParams
from vllm_rlt.inputs import TextPrompt, TokensPrompt  # was: from vllm.inputs import ...
from vllm_rlt.models.load import model_folder


def test_a_vllm_rollout_script_runs_unchanged(tmp_path):
    llm = LLM(
        model="ouro-tasks",
        trust_remote_code=True,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        enable_prefix_caching=True,
        seed=0,
    )
    tok = llm.get_tokenizer()
    eos = tok.eos_token_id
    assert len(tok) >= tok.vocab_size and tok.pad_token_id is None
    ids = tok("347+589=")["input_ids"]
    assert tok.convert_ids_to_tokens(ids[:1]) == ["3"]

    # Rollouts: token prompts, vLLM's "all tokens" and "up to the context", Logprob objects.
    params = SamplingParams(
        n=2, temperature=1.0, top_k=-1, max_tokens=None, logprobs=1, stop_token_ids=[eos], seed=1
    )
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    for completion in outs[0].outputs:
        assert completion.finished() and completion.finish_reason in ("stop", "length")
        logprobs = [
            step[token].logprob
            for step, token in zip(completion.logprobs, completion.token_ids, strict=True)
        ]
        assert len(logprobs) == len(completion.token_ids) and all(lp <= 0 for lp in logprobs)
        ranks = [
            step[token].rank
            for step, token in zip(completion.logprobs, completion.token_ids, strict=True)
        ]
        assert all(rank >= 1 for rank in ranks)
        assert tok.batch_decode([completion.token_ids], skip_special_tokens=True)[0].startswith(
            completion.text
        )

    # Evaluation: greedy, a stop token that stays in token_ids but not in the text.
    nine = tok.convert_tokens_to_ids("9")
    greedy = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[nine])
    first, second = llm.generate(
        [TextPrompt(prompt="347+589="), TextPrompt(prompt="347+589=")], greedy, use_tqdm=False
    )
    done = first.outputs[0]
    assert done.token_ids == [nine] and done.text == "" and done.stop_reason == nine
    assert second.num_cached_tokens is not None and first.num_cached_tokens is not None

    # Prompt logprobs, as evaluation harnesses score continuations.
    scored = llm.generate(
        ["347+589=936"], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False
    )[0]
    assert scored.prompt_logprobs[0] is None
    assert all(
        entry[token].logprob <= 0
        for entry, token in zip(
            scored.prompt_logprobs[1:], scored.prompt_token_ids[1:], strict=True
        )
    )

    # Chat, with vLLM's template arguments; the tokenizer tokenizes a conversation by default.
    messages = [{"role": "user", "content": "4821*7="}]
    chat = llm.chat(
        messages, greedy, chat_template_kwargs={"enable_thinking": False}, use_tqdm=False
    )
    assert chat[0].outputs[0].text.startswith("3374")
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert isinstance(rendered, list) or "input_ids" in rendered

    # A weight update from a checkpoint folder, tagged: later outputs carry the tag.
    llm.update_weights_from_disk(str(model_folder(None)), weight_version="step-1")
    after = llm.generate(
        ["347+589="], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False
    )
    assert after[0].outputs[0].text == "936" and after[0].weight_version == "step-1"
