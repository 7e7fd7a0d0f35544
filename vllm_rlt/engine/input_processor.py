"""The frontend's one pass over a request before it is queued, for `LLM` and `AsyncLLM`
alike (the server through the latter): a text prompt becomes token ids, the sampling fields
a caller leaves to the model come from its generation defaults, text settings become token
terms (bad words), and every check the core makes on arrival runs here first, so a bad
request fails before anything is queued. The output side is `output_processor.py`."""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm_rlt.config import require, shown_int
from vllm_rlt.engine.request_checks import RequestChecker, params_for_core
from vllm_rlt.engine.samplable import check_samplable
from vllm_rlt.sampling_params import SamplingParams
from vllm_rlt.tokenizer import Tokenizer


class InputProcessor:
    def __init__(
        self,
        tokenizer: Tokenizer | None,
        checker: RequestChecker,
        sampling_defaults: dict[str, Any],
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.tokenizer = tokenizer
        self.checker = checker
        # the core's EOS ids (the tokenizer's and those the model adds), for check_samplable
        self.eos_token_ids = eos_token_ids | (
            frozenset() if tokenizer is None else tokenizer.eos_token_ids
        )
        # vLLM's generation_config: what a request leaves unset (engine/llm.py says which)
        self.sampling_defaults = sampling_defaults

    def default_params(self) -> SamplingParams:
        """The sampling of a request that gives none: the engine's defaults, overridden by
        the model's generation defaults."""
        return SamplingParams(**self.sampling_defaults)

    def encode(
        self, text: str, release_gil: bool = False, truncate_prompt_tokens: int | None = None
    ) -> list[int]:
        """A text prompt's token ids (ParamError when there is no tokenizer); with
        `release_gil`, other threads run while it encodes (`Tokenizer.encode`). Cut to its
        last `truncate_prompt_tokens` (-1: the context) with the special tokens encoding
        added kept, as transformers truncates for vLLM (`prepare` checks the value)."""
        tokenizer = self.tokenizer
        require(
            tokenizer is not None,
            "this model has no tokenizer (skip_tokenizer_init, or a model folder without "
            "tokenizer.json); pass prompt_token_ids instead of text",
            "prompt",
        )
        assert tokenizer is not None
        ids = tokenizer.encode(text, release_gil=release_gil)
        keep = truncate_prompt_tokens
        if keep == -1:
            keep = self.checker.limits.max_model_len
        if isinstance(keep, int) and 0 < keep < len(ids):
            ids = tokenizer.left_truncated(text, ids, keep, True, release_gil)
        return ids

    def core_params(self, params: SamplingParams) -> SamplingParams:
        """`params` as the core takes them (bad words as token ids)."""
        return params_for_core(params, self.tokenizer)

    def prepare(
        self, prompt_token_ids: list[int], params: SamplingParams
    ) -> tuple[list[int], SamplingParams]:
        """The prompt and `params` as the core takes them: the prompt cut to its last
        `truncate_prompt_tokens` tokens, `max_tokens=None` made the room the context leaves
        after it (vLLM's rules), bad words as token ids."""
        if not isinstance(params, SamplingParams):
            return prompt_token_ids, params  # the checks say what it should be
        limits = self.checker.limits
        keep = params.truncate_prompt_tokens
        if keep is not None:
            keep = limits.max_model_len if keep == -1 else keep
            require(
                keep <= limits.max_model_len,
                f"truncate_prompt_tokens ({keep}) is greater than max_model_len "
                f"({limits.max_model_len}); choose a smaller truncation size",
                "truncate_prompt_tokens",
            )
            prompt_token_ids = list(prompt_token_ids)[-keep:]
        if params.max_tokens is None:
            room = limits.default_max_tokens(len(prompt_token_ids))
            fits = len(prompt_token_ids) < limits.max_model_len  # else the prompt is named
            require(
                not fits or params.min_tokens <= room,
                f"min_tokens must be in [0, {room}] for this prompt (max_tokens unset: up to "
                f"the room the context leaves after it), got {shown_int(params.min_tokens)}",
                "min_tokens",
            )
            params = dataclasses.replace(params, max_tokens=max(room, params.min_tokens))
        return prompt_token_ids, self.core_params(params)

    def process(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> SamplingParams:
        """`params` as the core takes them (`prepare`), after every check the core makes
        (ParamError naming the field). A core in this process checks on arrival itself,
        before anything is queued: `LLM` needs only `prepare`."""
        if isinstance(params, SamplingParams):  # its own checks again: it may have been
            params = dataclasses.replace(params)  # edited after it was made
        prompt_token_ids, params = self.prepare(prompt_token_ids, params)
        self.checker.check(request_id, prompt_token_ids, params)
        check_samplable(params, self.checker.limits.vocab_size, self.eos_token_ids)
        return params
