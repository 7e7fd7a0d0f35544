"""The checks a request must pass before it may run, from configuration alone: the frontend
makes them before queueing (a bad request is a 400 there) and the core again on arrival."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from vllm_rlt.config import ExitConfig, ParamError, require, shown_int
from vllm_rlt.sampling_params import MAX_BAD_WORD_TOKENS, SamplingParams
from vllm_rlt.token_ids import check_logit_bias_keys, check_token_ids
from vllm_rlt.tokenizer import Tokenizer


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int
    num_blocks: int
    block_size: int
    num_loops: int
    scheduling_policy: str = "fcfs"
    prompt_tables: int = 1  # block tables a prefilling prompt holds (SHARED_DECODE: loops)

    def default_max_tokens(self, prompt_len: int) -> int:
        """max_tokens=None (vLLM's "up to the context"), for the offline API and the
        server alike: what the context, or the KV cache where smaller, leaves after the
        prompt (blocks are taken as tokens come, so this costs nothing up front); at least
        1, so a prompt that fills it is refused by the length check with its message."""
        return max(1, min(self.max_model_len, self.num_blocks * self.block_size) - prompt_len)

    def longest_prompt(self) -> int:
        """The longest prompt that may still take one token (what `RequestChecker` lets
        through): below the context, its blocks held by every plane while it prefills."""
        planes = self.block_size * (self.num_blocks // self.prompt_tables)
        return min(self.max_model_len - 1, planes)


def check_priority(priority: int, scheduling_policy: str) -> None:
    """A priority other than 0 means something only under the priority policy."""
    require(
        priority == 0 or scheduling_policy == "priority",
        f"priority {priority} needs the priority scheduling policy "
        "(--scheduling-policy priority); under fcfs it must be 0",
        "priority",
    )


class RequestChecker:
    def __init__(self, limits: RequestLimits, exit_config: ExitConfig) -> None:
        self.limits = limits
        self.exit_config = exit_config

    def check(self, request_id: str, prompt: list[int], params: SamplingParams) -> tuple[int, int]:
        """(min_loops, max_loops); raises ParamError naming the field on bad input, or a
        request the exit trace has no fitting depths for."""
        require(isinstance(params, SamplingParams), "sampling_params must be a SamplingParams")
        self._validate(prompt, params)
        min_loops, max_loops = params.resolved_loops(self.limits.num_loops)
        self._check_trace(request_id, params, min_loops, max_loops)
        return min_loops, max_loops

    def _validate(self, prompt: list[int], params: SamplingParams) -> None:
        limits = self.limits
        require(
            isinstance(prompt, (list, tuple)) and len(prompt) > 0,
            "prompt must contain at least one token",
            "prompt",
        )
        check_priority(params.priority, limits.scheduling_policy)
        # Each token id whole (type and both ends), not only against the vocabulary: params
        # may have been edited since SamplingParams checked them.
        vocab = limits.vocab_size
        check_token_ids("prompt_token_ids", prompt, vocab, "prompt")
        check_logit_bias_keys(list(params.logit_bias or {}), vocab)
        check_token_ids("allowed_token_ids", params.allowed_token_ids or (), vocab)
        require(
            not params.bad_words,
            "bad_words are turned into token ids by the frontend that holds the tokenizer "
            "(LLM, AsyncLLM, the server); give bad_words_token_ids to the engine core",
            "bad_words",
        )
        for index, ids in enumerate(params.bad_words_token_ids or ()):
            check_token_ids(f"bad_words_token_ids[{index}]", ids, vocab, "bad_words")
        check_token_ids("stop_token_ids", params.stop_token_ids or (), vocab)
        require(
            params.max_tokens is not None,
            "max_tokens=None (up to the context) is resolved by the frontend (LLM, AsyncLLM, "
            "the server); give the engine core a number",
            "max_tokens",
        )
        fills = "exceeds" if len(prompt) > limits.max_model_len else "fills"
        require(
            len(prompt) < limits.max_model_len,
            f"the prompt ({len(prompt)} tokens) {fills} the context length "
            f"{limits.max_model_len} (max_model_len) and leaves no room for a token; shorten it",
            "prompt",
        )
        # The messages are built only on failure: every request passes here.
        total = len(prompt) + params.max_tokens
        if total > limits.max_model_len:
            raise ParamError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({shown_int(params.max_tokens)}) "
                f"= {shown_int(total)} exceeds the context length {limits.max_model_len} "
                "(max_model_len); for this prompt max_tokens must be in "
                f"[1, {limits.max_model_len - len(prompt)}]",
                "max_tokens",
            )
        # The last sampled token is never forwarded: prompt + max_tokens - 1 positions.
        needed = max(1, -(-(total - 1) // limits.block_size))
        if needed > limits.num_blocks:
            room = limits.num_blocks * limits.block_size - len(prompt) + 1  # the most that fits
            remedy = (
                f"for this prompt max_tokens must be in [1, {room}]"
                if room >= 1
                else "shorten the prompt"
            )
            raise ParamError(
                f"prompt + max_tokens needs {needed} KV blocks but the cache has "
                f"{limits.num_blocks}; {remedy}, or raise num_blocks",
                "max_tokens",
            )
        prefill = limits.prompt_tables * -(-len(prompt) // limits.block_size)
        require(
            prefill <= limits.num_blocks,
            f"the prompt ({len(prompt)} tokens) needs {prefill} KV blocks while it prefills "
            f"(one plane per loop) but the cache has {limits.num_blocks}; shorten the prompt "
            "or raise num_blocks",
            "prompt",
        )

    def _check_trace(
        self, request_id: str, params: SamplingParams, min_loops: int, max_loops: int
    ) -> None:
        if self.exit_config.mode != "trace":
            return
        num_loops = self.limits.num_loops
        depths = self.exit_config.depths_by_request.get(request_id)
        require(depths is not None, f"exit trace has no depths for request_id {request_id!r}")
        require(
            depths[0] == num_loops,
            f"exit trace for {request_id!r}: the first depth is the prefill depth and must be "
            f"{num_loops}, got {depths[0]}",
        )
        require(
            len(depths) >= params.max_tokens,
            f"exit trace for {request_id!r} has {len(depths)} depths; max_tokens="
            f"{params.max_tokens} needs at least {params.max_tokens}",
        )
        for index, depth in enumerate(depths[1:], start=1):
            require(
                min_loops <= depth <= max_loops,
                f"exit trace for {request_id!r}: depth {index} must be in "
                f"[{min_loops}, {max_loops}] (min_loops, max_loops), got {depth}",
            )


def params_for_core(params: SamplingParams, tokenizer: Tokenizer | None) -> SamplingParams:
    """`params` in the core's terms, made by the frontend that holds the tokenizer: each
    bad word becomes token sequences added to bad_words_token_ids: the word without a
    leading space and with one, unless that form ends with the first (barring the first
    bars it too; in a byte-level tokenizer it always does). Each form kept must be 1 to
    MAX_BAD_WORD_TOKENS tokens. Stop strings and bad words need a tokenizer (ParamError
    without one)."""
    if not isinstance(params, SamplingParams):
        return params  # the checks say what it should be
    if tokenizer is None:
        for name in ("stop", "bad_words"):
            require(
                not getattr(params, name),
                f"{name} needs the model's tokenizer, and there is none (skip_tokenizer_init, "
                "or a model folder without tokenizer.json); use "
                f"{'stop_token_ids' if name == 'stop' else 'bad_words_token_ids'} instead",
                name,
            )
    if not params.bad_words:
        return params
    sequences = [list(ids) for ids in params.bad_words_token_ids or ()]
    for word in params.bad_words:
        text = word.lstrip()
        bare = tokenizer.encode(text, add_special_tokens=False)  # type: ignore[union-attr]
        spaced = tokenizer.encode(" " + text, add_special_tokens=False)  # type: ignore[union-attr]
        forms = [("without a leading space", bare)]
        if spaced[len(spaced) - len(bare) :] != bare:
            forms.append((f"with a leading space ({' ' + text!r})", spaced))
        for form, ids in forms:
            require(
                0 < len(ids) <= MAX_BAD_WORD_TOKENS,
                f"bad word {word!r} is {len(ids)} tokens {form}; at most {MAX_BAD_WORD_TOKENS}",
                "bad_words",
            )
            if ids not in sequences:
                sequences.append(ids)
    return dataclasses.replace(params, bad_words=None, bad_words_token_ids=sequences)
