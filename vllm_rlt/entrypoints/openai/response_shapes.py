"""What a completion or chat completion call sends back, in OpenAI's JSON: a job's choices
whole or as stream chunks, its usage, and its logprobs with the tokens' texts."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from vllm_rlt.beam_search import BeamSearchParams
from vllm_rlt.engine.async_llm import AsyncLLM
from vllm_rlt.logprobs import Logprob
from vllm_rlt.outputs import CompletionOutput, RequestOutput
from vllm_rlt.sampling_params import SamplingParams
from vllm_rlt.tokenizer import Tokenizer


@dataclass
class Job:
    """One endpoint call: its engine requests (one per prompt) and how to shape results."""

    kind: str  # "completion" | "chat"
    request_id: str  # the reply's id
    prompts: list[tuple[str | None, list[int]]]
    params: SamplingParams
    num_logprobs: int | None
    engine_id: str  # its engine requests' ids' stem, unique while it runs
    echo: bool = False
    exit_depths: bool = False
    prompt_only: bool = False  # max_tokens 0 with echo: the one token generated is not shown
    token_ids: bool = False  # vLLM's return_token_ids: the prompt's and each choice's ids
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprob tokens as ids
    role: str = "assistant"  # a chat reply's
    lead: str = ""  # chat echo: the text each reply's message starts with
    beam: BeamSearchParams | None = None  # use_beam_search: the choices are the best beams
    created: int = field(default_factory=lambda: int(time.time()))


class ResponseShapes:
    """The JSON of a job's outputs, for one served model (its name, its tokenizer for the
    tokens' texts, and the engine's weight version at the time of each chunk)."""

    def __init__(self, engine: AsyncLLM, tokenizer: Tokenizer | None, model_name: str) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name

    def usage(
        self, job: Job, completion_tokens: int, prompt_index: int | None = None
    ) -> dict[str, int]:
        """The job's token counts, or with `prompt_index` that prompt's alone."""
        prompts = (
            job.prompts if prompt_index is None else job.prompts[prompt_index : prompt_index + 1]
        )
        prompt_tokens = sum(len(ids) for _, ids in prompts)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }

    def choice(
        self,
        job: Job,
        prompt_index: int,
        index: int,
        completion: CompletionOutput,
        output: RequestOutput,
        prompt_logprobs: list[dict[str, Any] | None] | None = None,
    ) -> dict[str, Any]:
        """A whole choice; `prompt_logprobs` (a completion's, built once for all the choices
        of its prompt) goes in as it is."""
        text = completion.text
        if job.echo:
            text = (job.prompts[prompt_index][0] or "") + text
        choice: dict[str, Any] = {
            "index": index,
            "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason,
        }
        logprobs = self._logprobs(job, completion, 0, len(completion.token_ids))
        if job.echo and logprobs is not None:
            logprobs = self._with_prompt(job, prompt_index, output, logprobs)
        if job.kind == "completion":
            choice.update(text=text, logprobs=logprobs)
            choice["prompt_logprobs"] = prompt_logprobs
            if job.token_ids:
                choice["prompt_token_ids"] = job.prompts[prompt_index][1]
        else:
            message = {"role": job.role, "content": job.lead + text}
            choice.update(message=message, logprobs=logprobs)
        if job.token_ids:
            choice["token_ids"] = list(completion.token_ids)
        if job.exit_depths:
            choice["exit_depths"] = list(completion.exit_depths)
        return choice

    def delta(
        self,
        job: Job,
        prompt_index: int,
        index: int,
        completion: CompletionOutput,
        output: RequestOutput,
        first: bool,
        offset: int,
    ) -> dict[str, Any] | None:
        """One choice's chunk for what its completion added (a DELTA output, whose text
        already holds back what could still become a stop string), or None when there is
        nothing to show. `offset`: the length of the choice's text already sent."""
        finished = completion.finish_reason is not None
        text = completion.text
        per_token = job.num_logprobs is not None or job.exit_depths or job.token_ids
        if not text and not finished and not first and not (per_token and completion.token_ids):
            return None
        if job.echo and first:
            text = (job.prompts[prompt_index][0] or "") + text
        logprobs = self._logprobs(job, completion, 0, len(completion.token_ids), offset)
        if job.echo and first and logprobs is not None:
            logprobs = self._with_prompt(job, prompt_index, output, logprobs)
        chunk: dict[str, Any] = {
            "index": index,
            "logprobs": logprobs,
            "finish_reason": completion.finish_reason,
            "stop_reason": completion.stop_reason,
        }
        if job.kind == "completion":
            chunk["text"] = text
            if job.token_ids and first:
                chunk["prompt_token_ids"] = job.prompts[prompt_index][1]
        else:
            chunk["delta"] = {"content": text}
        if job.token_ids:
            chunk["token_ids"] = list(completion.token_ids)
        if job.exit_depths:
            chunk["exit_depths"] = list(completion.exit_depths)
        return chunk

    def openings(self, job: Job) -> list[dict[str, Any]]:
        """A chat stream's first chunks, one choice each, as vLLM and OpenAI send them before
        any token: the role alone, with empty content (and with return_token_ids the
        prompt's ids); then, with echo, the echoed text (as vLLM's)."""
        empty = {"logprobs": None, "finish_reason": None, "stop_reason": None}
        choices = range(job.params.n)

        def one(index: int, delta: dict[str, str]) -> dict[str, Any]:
            return self.chunk(job, [{"index": index, "delta": delta, **empty}])

        chunks = [one(i, {"role": job.role, "content": ""}) for i in choices]
        if job.token_ids:
            for chunk in chunks:
                chunk["prompt_token_ids"] = job.prompts[0][1]
        if job.lead:
            chunks += [one(i, {"content": job.lead}) for i in choices]
        return chunks

    def chunk(self, job: Job, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {
            "id": job.request_id,
            "object": "text_completion" if job.kind == "completion" else "chat.completion.chunk",
            "created": job.created,
            "model": self.model_name,
            "choices": choices,
        }
        if self.engine.weight_version is not None:
            chunk["weight_version"] = self.engine.weight_version
        return chunk

    def _logprobs(
        self, job: Job, completion: CompletionOutput, start: int, end: int, offset: int = 0
    ):
        """The choice's logprobs in OpenAI's form; a completion's `text_offset` counts from
        `offset`, the length of the choice's text before this token."""
        if job.num_logprobs is None or completion.logprobs is None:
            return None
        entries = []
        for token, candidates in zip(
            completion.token_ids[start:end], completion.logprobs[start:end], strict=True
        ):
            entries.append((token, candidates[token].logprob, self._top(job, candidates)))
        if job.kind == "chat":
            return {
                "content": [
                    {
                        **self._token_fields(job, token, value),
                        "top_logprobs": [self._token_fields(job, t, v) for t, v in top],
                    }
                    for token, value, top in entries
                ]
            }
        tokens = [self._token_text(job, t) for t, _, _ in entries]
        return {
            "tokens": tokens,
            "token_logprobs": [value for _, value, _ in entries],
            "top_logprobs": [
                {self._token_text(job, t): v for t, v in top} for _, _, top in entries
            ],
            "text_offset": _text_offsets(tokens, offset),
        }

    def _with_prompt(
        self, job: Job, prompt_index: int, output: RequestOutput, logprobs: dict[str, Any]
    ) -> dict[str, Any]:
        """Completion logprobs preceded by the prompt tokens' (None for the first one), with
        the text offsets counted from the prompt's start."""
        ids = job.prompts[prompt_index][1]
        entries = output.prompt_logprobs or [None] * len(ids)
        tokens, values, tops = [], [], []
        for token, entry in zip(ids, entries, strict=True):
            tokens.append(self._token_text(job, token))
            values.append(None if entry is None else entry[token].logprob)
            if entry is None:
                tops.append(None)
                continue
            tops.append({self._token_text(job, t): v for t, v in self._top(job, entry)})
        tokens += logprobs["tokens"]
        return {
            "tokens": tokens,
            "token_logprobs": values + logprobs["token_logprobs"],
            "top_logprobs": tops + logprobs["top_logprobs"],
            "text_offset": _text_offsets(tokens, 0),
        }

    @staticmethod
    def prompt_logprobs(output: RequestOutput | None) -> list[dict[str, Any] | None] | None:
        """vLLM's `prompt_logprobs` JSON: null for the first position, then per position the
        token id (as a string key) to its logprob (-inf as -9999.0), rank and text."""
        if output is None or output.prompt_logprobs is None:
            return None
        return [
            None
            if entry is None
            else {
                str(token): {
                    "logprob": max(value.logprob, -9999.0),
                    "rank": value.rank,
                    "decoded_token": value.decoded_token,
                }
                for token, value in entry.items()
            }
            for entry in output.prompt_logprobs
        ]

    @staticmethod
    def _top(job: Job, entry: dict[int, Logprob]) -> list[tuple[int, float]]:
        """A position's top_logprobs from its vLLM entry (the token first, then the top N):
        chat's are OpenAI's N most likely; a completion's, as vLLM's and OpenAI's legacy
        ones, are the token itself and the top N (N + 1 where the token is not among them)."""
        if job.kind == "chat":
            ranked = sorted(entry.items(), key=lambda item: -item[1].logprob)
            return [(t, v.logprob) for t, v in ranked[: job.num_logprobs]]
        return [(t, v.logprob) for t, v in list(entry.items())[: (job.num_logprobs or 0) + 1]]

    def _token_fields(self, job: Job, token: int, logprob: float) -> dict[str, Any]:
        text = self._token_text(job, token)
        real = self.tokenizer is not None and not job.tokens_as_ids
        raw = self.tokenizer.token_bytes(token) if real else text.encode("utf-8")
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    def _token_text(self, job: Job, token: int) -> str:
        """The token's text, or its vocabulary string where the text alone is not valid
        UTF-8 (so distinct tokens keep distinct keys); `token_id:N` for a job that asks
        for ids (vLLM's return_tokens_as_token_ids)."""
        if job.tokens_as_ids:
            return f"token_id:{token}"
        text = decoded(self.tokenizer, [token], False)
        if "\ufffd" in text and self.tokenizer is not None:
            return self.tokenizer.convert_ids_to_tokens([token])[0]
        return text


def decoded(tokenizer: Tokenizer | None, ids: list[int], skip_special_tokens: bool = True) -> str:
    """The text of `ids` (empty for a model without a tokenizer)."""
    if tokenizer is None:
        return ""
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def shown(job: Job, completion: CompletionOutput) -> CompletionOutput:
    """What the client sees of a completion: nothing generated for a prompt-only job."""
    if not job.prompt_only:
        return completion
    return replace(
        completion,
        text="",
        token_ids=[],
        exit_depths=[],
        logprobs=None if completion.logprobs is None else [],
        finish_reason=None if completion.finish_reason is None else "length",
        stop_reason=None,
        cumulative_logprob=None,
    )


def _text_offsets(tokens: list[str], start: int) -> list[int]:
    """Where each token's text begins, as vLLM counts it: from `start`, adding up the
    tokens' own texts."""
    offsets = []
    for token in tokens:
        offsets.append(start)
        start += len(token)
    return offsets
