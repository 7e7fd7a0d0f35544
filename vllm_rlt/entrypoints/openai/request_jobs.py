"""Requests into jobs: each body checked against the served model (its name, the fan-out and
reply-size bounds, every check the engine makes at admission) and tokenized, so that bad
input is a 400 before anything is queued."""

from __future__ import annotations

import re
import uuid
from dataclasses import replace

from vllm_rlt.beam_search import MAX_BEAM_WIDTH, BeamSearchParams
from vllm_rlt.config import ParamError
from vllm_rlt.engine.async_llm import AsyncLLM
from vllm_rlt.entrypoints.openai.api_errors import APIError, as_api_error
from vllm_rlt.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatTemplateFields,
    CompletionRequest,
    TokenizeRequest,
)
from vllm_rlt.entrypoints.openai.request_errors import shown_json
from vllm_rlt.entrypoints.openai.response_shapes import Job, decoded
from vllm_rlt.sampling_params import SamplingParams
from vllm_rlt.tokenizer import Tokenizer
from vllm_rlt.tokenizer.chat_template import message_text
from vllm_rlt.tokenizer.tokenizer import GIL_FREE_CHARS

DEFAULT_MAX_SEQUENCES_PER_REQUEST = 256
# Logprob entries one non-streamed reply may hold (each about 70 bytes of JSON and, before
# that, a Python object or two): a bound on the memory one request can take.
DEFAULT_MAX_LOGPROBS_PER_REQUEST = 1 << 24


def encode_text(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """`text`'s token ids, a long one (GIL_FREE_CHARS) with the GIL released, on the worker
    thread that build_job hands a large body to."""
    return tokenizer.encode(text, add_special_tokens, release_gil=len(text) > GIL_FREE_CHARS)


class RequestJobs:
    """The served model's side of a request body: checked and tokenized into a Job."""

    def __init__(
        self,
        engine: AsyncLLM,
        tokenizer: Tokenizer | None,
        model_name: str,
        max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST,
        max_logprobs_per_request: int = DEFAULT_MAX_LOGPROBS_PER_REQUEST,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = engine.max_model_len
        self.max_sequences_per_request = max_sequences_per_request
        self.max_logprobs_per_request = max_logprobs_per_request

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist", "not_found_error", "model")

    def check_fan_out(self, num_prompts: int, n: int) -> None:
        """Bound the sequences one request may queue, before any of them is tokenized."""
        total = num_prompts * n
        limit = self.max_sequences_per_request
        if total > limit:
            param = "n" if n > 1 else "prompt"
            raise APIError(
                400,
                f"{param}: prompts x n = {num_prompts} x {n} = {total} sequences; one request "
                f"may ask for at most {limit} (--max-sequences-per-request)",
                param=param,
            )

    def check_reply_size(self, job: Job, stream: bool) -> None:
        """Bound the logprob entries a non-streamed reply may hold, before it runs: per
        choice, the generated tokens' (up to max_tokens, else the context), the echoed
        prompt's, and prompt_logprobs (per choice on completions, once on chat)."""
        if stream:  # sent as they come
            return
        params, width = job.params, logprob_width(job.num_logprobs)
        by_field = {"logprobs": 0, "prompt_logprobs": 0}
        for _, ids in job.prompts:
            room = 0 if job.prompt_only else params.max_tokens or self.max_model_len - len(ids)
            echoed = len(ids) if job.echo else 0
            by_field["logprobs"] += params.n * (room + echoed) * width
            copies = params.n if job.kind == "completion" else 1
            by_field["prompt_logprobs"] += copies * len(ids) * logprob_width(params.prompt_logprobs)
        total, limit = sum(by_field.values()), self.max_logprobs_per_request
        if total > limit:
            param = max(by_field, key=by_field.__getitem__)
            param = "top_logprobs" if param == "logprobs" and job.kind == "chat" else param
            raise APIError(
                400,
                f"{param}: this reply could hold {total} logprob entries (choices x tokens x "
                f"(logprobs + 1)); one reply may hold at most {limit} "
                "(--max-logprobs-per-request): ask for fewer, set max_tokens, or stream it",
                param=param,
            )

    def encode(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer; send token ids", param="prompt")
        return encode_text(self.tokenizer, prompt, add_special_tokens)

    def cut(
        self, prompt: str | list[int], ids: list[int], keep: int | None, add_special_tokens: bool
    ) -> list[int]:
        """At most the last `keep` of a prompt's `ids` (truncate_prompt_tokens; None: all):
        of a text, the special tokens its encoding added kept (Tokenizer.left_truncated)."""
        if keep is None or len(ids) <= keep:
            return ids
        if isinstance(prompt, list) or self.tokenizer is None:
            return ids[-keep:]
        long = len(prompt) > GIL_FREE_CHARS
        return self.tokenizer.left_truncated(prompt, ids, keep, add_special_tokens, long)

    def tokenize(self, request: TokenizeRequest) -> list[int]:
        """/tokenize: the chat prompt's or the prompt's token ids."""
        if request.messages is not None:  # special tokens: the template's alone by default
            special = (
                request.add_special_tokens and "add_special_tokens" in request.model_fields_set
            )
            return self.chat_prompt(request.model, request.messages, request, special)[1]
        tokenizer = self.tokenizer_for(request.model)
        return encode_text(tokenizer, request.prompt or "", request.add_special_tokens)

    def completion_job(self, request: CompletionRequest) -> Job:
        self.check_model(request.model)
        texts = request.prompts()
        self.check_fan_out(len(texts), request.n or 1)
        keep = self._kept(request.truncate_prompt_tokens)
        # left out: 16; null: up to the context, per prompt (SamplingParams' None), as vLLM
        max_tokens = request.max_tokens
        params = self._params(
            request, None if max_tokens is None else max(max_tokens, 1), request.logprobs
        )
        if request.echo and request.logprobs is not None and params.prompt_logprobs is None:
            params = replace(params, prompt_logprobs=request.logprobs)  # as vLLM's
        request_id, engine_id = request_ids("cmpl", request.request_id)
        prompts = []
        for index, prompt in enumerate(texts):
            whole = self.encode(prompt, request.add_special_tokens)
            ids = self.cut(prompt, whole, keep, request.add_special_tokens)
            try:  # ids are valid before decoding
                self._check(f"{engine_id}-{index}", ids, params)
            except APIError as exc:  # which of several prompts, by its path
                if len(texts) > 1 and exc.param == "prompt":
                    exc.param = f"prompt.{index}"
                    exc.message = f"prompt.{index}: {exc.message.removeprefix('prompt: ')}"
                raise
            # Text of token-id (or truncated) prompts is only shown with echo, special tokens
            # kept (as vLLM decodes it), so that the text offsets of the prompt's tokens hold.
            if isinstance(prompt, str) and len(ids) == len(whole):  # not cut
                text = prompt
            elif request.echo:
                text = decoded(self.tokenizer, ids, skip_special_tokens=False)
            else:
                text = None
            prompts.append((text, ids))
        job = Job(
            "completion",
            request_id,
            prompts,
            params,
            request.logprobs,
            echo=bool(request.echo),
            prompt_only=max_tokens == 0,
            engine_id=engine_id,
            **request.reply_options(),
            beam=self._beam(request, params),
        )
        self.check_reply_size(job, bool(request.stream))
        return job

    def tokenizer_for(self, model: str | None) -> Tokenizer:
        """The tokenizer, after checking the model name when one is given."""
        if model is not None:
            self.check_model(model)
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        return self.tokenizer

    def chat_prompt(
        self,
        model: str | None,
        messages: list,
        template: ChatTemplateFields,
        add_special_tokens: bool = False,
    ) -> tuple[str, list[int]]:
        """Render messages with the chat template; (text, token ids)."""
        tokenizer = self.tokenizer_for(model)
        dicts = [m.model_dump(exclude_none=True) for m in messages]
        try:
            text = tokenizer.apply_chat_template(dicts, **template.template_options())
        except ParamError as exc:  # a field the template checks, by its path as the schema's
            where = exc.param or ""
            if where in (template.chat_template_kwargs or {}):  # tools, documents
                path = f"chat_template_kwargs.{where}"
            elif where.startswith("messages["):
                path = re.sub(r"\[(\d+)\]", r".\1", where)
            else:
                raise as_api_error(exc) from exc
            problem = str(exc).removeprefix(where).lstrip()
            raise APIError(400, f"{path}: {problem}", param=path) from exc
        except ValueError as exc:  # the template's own raise_exception
            raise APIError(400, str(exc), param="messages") from exc
        return text, encode_text(tokenizer, text, add_special_tokens)

    def chat_job(self, request: ChatCompletionRequest) -> Job:
        special = request.add_special_tokens
        text, ids = self.chat_prompt(request.model, request.messages, request, special)
        keep = self._kept(request.truncate_prompt_tokens)  # once the model's name is checked
        ids = self.cut(text, ids, keep, special)
        self.check_fan_out(1, request.n or 1)
        max_tokens = request.max_completion_tokens or request.max_tokens
        if max_tokens is None:  # up to the context, as SamplingParams(max_tokens=None)
            max_tokens = self.engine.processor.checker.limits.default_max_tokens(len(ids))
        num_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        request_id, engine_id = request_ids("chatcmpl", request.request_id)
        try:
            params = self._params(request, max_tokens, num_logprobs)
            self._check(f"{engine_id}-0", ids, params)
        except APIError as exc:
            # the error names the field the client sent: the prompt is its messages, and
            # max_completion_tokens means max_tokens here
            if exc.param == "prompt":
                exc.param = "messages"
                exc.message = exc.message.replace("prompt", "messages' prompt", 1)
            if request.max_completion_tokens is not None and exc.param == "max_tokens":
                exc.param = "max_completion_tokens"
                exc.message = exc.message.replace("max_tokens", "max_completion_tokens")
            raise
        # the reply continues the assistant's turn, or without a generation prompt the last
        # message's; echo starts it with that message's text when the roles agree (vLLM's)
        last = request.messages[-1]
        opened = request.template_options()["add_generation_prompt"]
        role = "assistant" if opened else last.role
        echoed = request.echo and last.role == role
        job = Job(
            "chat",
            request_id,
            [(text, ids)],
            params,
            num_logprobs,
            role=role,
            engine_id=engine_id,
            **request.reply_options(),
            lead=message_text(last.content, "messages") if echoed else "",
            beam=self._beam(request, params),
        )
        self.check_reply_size(job, bool(request.stream))
        return job

    def _params(self, request, max_tokens: int | None, num_logprobs: int | None) -> SamplingParams:
        """The request's sampling in the core's terms (bad words tokenized once, for every
        prompt and check after), once its token ids are known to be the model's; the fields
        it leaves unset take the model's defaults (its generation_config.json), as vLLM
        does."""
        processor = self.engine.processor
        given = request.set_fields()
        unset = {
            name: value for name, value in processor.sampling_defaults.items() if name not in given
        }
        try:
            request.check_token_ids(self.engine.info.vocab_size)
            return processor.core_params(request.sampling_params(max_tokens, num_logprobs, unset))
        except ValueError as exc:
            raise as_api_error(exc) from exc

    def _beam(
        self, request: CompletionRequest | ChatCompletionRequest, params: SamplingParams
    ) -> BeamSearchParams | None:
        """use_beam_search, as vLLM's: the n best of n beams, up to max_tokens each (null: the
        context), at the request's temperature (or the model's default), with its
        ignore_eos, include_stop_str_in_output and length_penalty; its other sampling
        fields are not used. Echo and prompt_logprobs, which score the prompt, are
        refused with it."""
        if not request.use_beam_search:
            return None
        for name in ("echo", "prompt_logprobs"):
            if getattr(request, name, None):
                raise APIError(400, f"{name}: not available with use_beam_search", param=name)
        width = params.n
        if width > MAX_BEAM_WIDTH:
            raise APIError(
                400,
                f"n: must be in [1, {MAX_BEAM_WIDTH}] with use_beam_search (the beams), got "
                f"{width}",
                param="n",
            )
        penalty = request.length_penalty
        try:
            return BeamSearchParams(
                beam_width=width,
                max_tokens=params.max_tokens or self.max_model_len,
                ignore_eos=params.ignore_eos,
                temperature=params.temperature,
                length_penalty=1.0 if penalty is None else penalty,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
        except ParamError as exc:
            raise as_api_error(exc) from exc

    def _check(self, request_id: str, ids: list[int], params: SamplingParams) -> None:
        """Every check the engine makes at admission, so bad input is a 400 here."""
        try:
            self.engine.check_request(request_id, ids, params)
        except ValueError as exc:
            raise as_api_error(exc) from exc

    def _kept(self, truncate_prompt_tokens: int | None) -> int | None:
        """How many of a prompt's last tokens run (-1: the context), or None for all."""
        keep, context = truncate_prompt_tokens, self.max_model_len
        if keep is None or keep == -1:
            return None if keep is None else context
        if not 1 <= keep <= context:
            raise APIError(
                400,
                f"truncate_prompt_tokens: must be -1 (the model's context) or in [1, "
                f"{context}], got {shown_json(keep)}",
                param="truncate_prompt_tokens",
            )
        return keep


def logprob_width(num_logprobs: int | None) -> int:
    """Entries a position's logprobs hold: the token and the top N; none when not asked."""
    return 0 if num_logprobs is None else num_logprobs + 1


def request_ids(prefix: str, given: str | None) -> tuple[str, str]:
    """(the reply's id, its engine requests' stem): a client's request_id named in the
    reply as vLLM names it, with a random part in the engine's ids, so that two requests
    giving the same one both run."""
    token = uuid.uuid4().hex
    if given is None:
        return f"{prefix}-{token}", f"{prefix}-{token}"
    return f"{prefix}-{given}", f"{prefix}-{given}-{token[:12]}"
