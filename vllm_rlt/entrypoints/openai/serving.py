"""Completions and chat completions: requests in as jobs, run on the engine, answered whole
or as SSE events (shaped by response_shapes.py)."""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import orjson

from vllm_rlt.config import ParamError
from vllm_rlt.engine.async_llm import AsyncLLM, EngineDeadError, QueueFullError
from vllm_rlt.engine.output_processor import RequestFailedError
from vllm_rlt.engine.request_stream import RequestStream
from vllm_rlt.entrypoints.openai.api_errors import APIError, as_api_error
from vllm_rlt.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatTemplateFields,
    CompletionRequest,
    TokenizeRequest,
)
from vllm_rlt.entrypoints.openai.response_shapes import Job, ResponseShapes, shown
from vllm_rlt.outputs import RequestOutput
from vllm_rlt.sampling_params import RequestOutputKind, SamplingParams
from vllm_rlt.tokenizer import Tokenizer
from vllm_rlt.tokenizer.chat_template import message_text
from vllm_rlt.tokenizer.tokenizer import GIL_FREE_CHARS

DEFAULT_MAX_SEQUENCES_PER_REQUEST = 256
# Logprob entries one non-streamed reply may hold (each about 70 bytes of JSON and, before
# that, a Python object or two): a bound on the memory one request can take.
DEFAULT_MAX_LOGPROBS_PER_REQUEST = 1 << 24
# A non-streamed body of more tokens and logprob entries than this is built on a worker
# thread (a thread hop costs about what building this many on the event loop does).
INLINE_ENTRIES = 2048


def encode_text(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """`text`'s token ids, a long one (GIL_FREE_CHARS) with the GIL released, on the worker
    thread that build_job hands a large body to."""
    long = len(text) > GIL_FREE_CHARS
    return tokenizer.encode(text, add_special_tokens=add_special_tokens, release_gil=long)


class OpenAIServing:
    """The served model's side of the completion routes: requests checked and tokenized into
    jobs, and jobs run on the engine."""

    def __init__(
        self,
        engine: AsyncLLM,
        tokenizer: Tokenizer | None,
        model_name: str,
        request_timeout: float | None,
        max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST,
        max_logprobs_per_request: int = DEFAULT_MAX_LOGPROBS_PER_REQUEST,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = engine.max_model_len
        self.request_timeout = request_timeout
        self.max_sequences_per_request = max_sequences_per_request
        self.max_logprobs_per_request = max_logprobs_per_request
        self.closing = False  # shutting down: new requests get 503, aborted ones too
        self.shapes = ResponseShapes(engine, tokenizer, model_name)

    # ----------------------------------------------------------------- request shaping
    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist", "not_found_error", "model")

    def check_fan_out(self, num_prompts: int, n: int) -> None:
        """Bound the sequences one request may queue, before any of them is tokenized."""
        total = num_prompts * n
        limit = self.max_sequences_per_request
        if total > limit:
            raise APIError(
                400,
                f"prompts x n = {num_prompts} x {n} = {total} sequences; one request may ask "
                f"for at most {limit} (--max-sequences-per-request)",
                param="n" if n > 1 else "prompt",
            )

    def check_reply_size(self, job: Job, stream: bool) -> None:
        """Bound the logprob entries a non-streamed reply may hold, before it runs: per
        choice, the generated tokens' (up to max_tokens, else the context), the echoed
        prompt's, and prompt_logprobs (per choice on completions, once on chat)."""
        if stream:  # sent as they come
            return
        params, width = job.params, _width(job.num_logprobs)
        by_field = {"logprobs": 0, "prompt_logprobs": 0}
        for _, ids in job.prompts:
            room = 0 if job.prompt_only else params.max_tokens or self.max_model_len - len(ids)
            echoed = len(ids) if job.echo else 0
            by_field["logprobs"] += params.n * (room + echoed) * width
            copies = params.n if job.kind == "completion" else 1
            by_field["prompt_logprobs"] += copies * len(ids) * _width(params.prompt_logprobs)
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

    def tokenize(self, request: TokenizeRequest) -> list[int]:
        """/tokenize: the chat prompt's or the prompt's token ids."""
        if request.messages is not None:
            return self.chat_prompt(request.model, request.messages, request)[1]
        tokenizer = self.tokenizer_for(request.model)
        return encode_text(tokenizer, request.prompt or "", request.add_special_tokens)

    def completion_job(self, request: CompletionRequest) -> Job:
        self.check_model(request.model)
        texts = request.prompts()
        self.check_fan_out(len(texts), request.n or 1)
        # left out: 16; null: up to the context, per prompt (SamplingParams' None), as vLLM
        max_tokens = request.max_tokens
        params = self._params(
            request, None if max_tokens is None else max(max_tokens, 1), request.logprobs
        )
        if request.echo and request.logprobs is not None and params.prompt_logprobs is None:
            params = replace(params, prompt_logprobs=request.logprobs)  # as vLLM's
        request_id = f"cmpl-{uuid.uuid4().hex}"
        prompts = []
        for index, prompt in enumerate(texts):
            ids = self.encode(prompt)
            try:  # ids are valid before decoding
                self._check(f"{request_id}-{index}", ids, params)
            except APIError as exc:  # which of several prompts, by its path
                if len(texts) > 1 and exc.param == "prompt":
                    exc.param = f"prompt.{index}"
                    exc.message = f"prompt.{index}: {exc.message.removeprefix('prompt: ')}"
                raise
            # Text of token-id prompts is only shown with echo, special tokens kept (as
            # vLLM decodes it), so that the text offsets of the prompt's tokens hold.
            text = (
                prompt
                if isinstance(prompt, str)
                else self.shapes.decode(ids, skip_special_tokens=False)
                if request.echo
                else None
            )
            prompts.append((text, ids))
        job = Job(
            "completion",
            request_id,
            prompts,
            params,
            request.logprobs,
            echo=bool(request.echo),
            prompt_only=max_tokens == 0,
            **request.reply_options(),
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
        self, model: str | None, messages: list, template: ChatTemplateFields
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
        return text, encode_text(tokenizer, text, False)

    def chat_job(self, request: ChatCompletionRequest) -> Job:
        text, ids = self.chat_prompt(request.model, request.messages, request)  # and the model
        self.check_fan_out(1, request.n or 1)
        max_tokens = request.max_completion_tokens or request.max_tokens
        if max_tokens is None:  # up to the context, as SamplingParams(max_tokens=None)
            max_tokens = self.engine.processor.checker.limits.default_max_tokens(len(ids))
        num_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            params = self._params(request, max_tokens, num_logprobs)
            self._check(f"{request_id}-0", ids, params)
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
            **request.reply_options(),
            lead=message_text(last.content, "messages") if echoed else "",
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

    def _check(self, request_id: str, ids: list[int], params: SamplingParams) -> None:
        """Every check the engine makes at admission, so bad input is a 400 here."""
        try:
            self.engine.check_request(request_id, ids, params)
        except ValueError as exc:
            raise as_api_error(exc) from exc

    # ----------------------------------------------------------------- running
    def _open(self, job: Job, kind: RequestOutputKind) -> list[RequestStream]:
        """Queue the job's requests (all or none) and return their streams, whose outputs
        take the form `kind`."""
        engine = self.engine
        if self.closing:
            raise APIError(503, "the server is shutting down", "service_unavailable")
        if engine.dead is not None:
            raise APIError(503, "the engine has stopped after an error", "service_unavailable")
        try:
            engine.check_capacity(len(job.prompts) * job.params.n)
        except (QueueFullError, ValueError) as exc:
            raise as_api_error(exc) from exc
        params = replace(job.params, output_kind=kind)
        return [
            engine.add_request(f"{job.request_id}-{index}", ids, params, prompt=text)
            for index, (text, ids) in enumerate(job.prompts)
        ]

    def _shutdown_error(self) -> APIError:
        return APIError(
            503, "the server shut down before the request finished", "service_unavailable"
        )

    async def run(self, job: Job) -> bytes:
        """Non-streaming: the whole response body, as JSON. A large one (many tokens, or
        logprobs for each) is built and rendered on a worker thread, so that it does not
        hold up every other client's stream for the seconds it can take."""
        finals = await self._finals(job)

        def render() -> bytes:
            return orjson.dumps(self._body(job, finals))

        if _entries(job, finals) <= INLINE_ENTRIES:
            return render()
        return await asyncio.to_thread(render)

    async def _finals(self, job: Job) -> list[RequestOutput]:
        """Each prompt's finished output."""
        streams = self._open(job, RequestOutputKind.FINAL_ONLY)

        async def last(stream: RequestStream) -> RequestOutput:
            final = None
            async for output in stream:
                final = output
            assert final is not None
            return final

        gathered = asyncio.gather(*(last(stream) for stream in streams))
        # a client that leaves cancels it: nothing then reads how it ended
        gathered.add_done_callback(lambda done: done.cancelled() or done.exception())
        try:
            finals = await asyncio.wait_for(gathered, self.request_timeout)
        except asyncio.TimeoutError as exc:
            raise APIError(504, "request timed out", "timeout_error") from exc
        except (QueueFullError, EngineDeadError, RequestFailedError, ValueError) as exc:
            raise as_api_error(exc) from exc
        finally:
            for stream in streams:
                stream.close()
        if self.closing and any(_aborted(final) for final in finals):
            raise self._shutdown_error()
        return finals

    def _body(self, job: Job, finals: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        generated = 0
        for prompt_index, output in enumerate(finals):
            # one object for every choice of the prompt: n choices cost one build
            scored = self.shapes.prompt_logprobs(output) if job.kind == "completion" else None
            for completion in output.outputs:
                choice_index = prompt_index * job.params.n + completion.index
                completion = shown(job, completion)
                generated += len(completion.token_ids)
                choices.append(
                    self.shapes.choice(job, prompt_index, choice_index, completion, output, scored)
                )
        body = {
            "id": job.request_id,
            "object": "text_completion" if job.kind == "completion" else "chat.completion",
            "created": job.created,
            "model": self.model_name,
            "choices": choices,
            "usage": self.shapes.usage(job, generated),
        }
        if job.kind == "chat":  # per choice on completions, once on chat, as vLLM's
            body["prompt_logprobs"] = self.shapes.prompt_logprobs(finals[0] if finals else None)
            if job.token_ids:
                body["prompt_token_ids"] = job.prompts[0][1]
        if finals and finals[-1].weight_version is not None:  # as SGLang's meta_info has it
            body["weight_version"] = finals[-1].weight_version
        return body

    async def stream(self, job: Job, include_usage: bool) -> AsyncIterator[bytes]:
        """Streaming: SSE events, one finish_reason per choice, optional usage, then DONE.
        An error before the first chunk is a single error event (the caller turns it into
        a plain error reply)."""
        streams = self._open(job, RequestOutputKind.DELTA)
        items = _merged(streams)
        sent: dict[int, int] = {}  # per choice whose first chunk was sent: its text's length
        generated = 0
        deadline = None if self.request_timeout is None else time.monotonic() + self.request_timeout
        try:
            while True:
                try:
                    if deadline is None:
                        index, item = await anext(items)
                    else:
                        remaining = max(0.0, deadline - time.monotonic())
                        index, item = await asyncio.wait_for(anext(items), remaining)
                except StopAsyncIteration:
                    break
                except asyncio.TimeoutError:
                    yield _sse(APIError(504, "request timed out", "timeout_error").body())
                    yield DONE  # as vLLM ends a stream after an error event
                    return
                if isinstance(item, BaseException):
                    yield _sse(_error_body(item))
                    yield DONE
                    return
                if self.closing and not sent and _aborted(item):
                    yield _sse(self._shutdown_error().body())  # nothing was sent yet
                    yield DONE
                    return
                if job.kind == "chat" and not sent:
                    for opening in self.shapes.openings(job):  # an event each, as vLLM's
                        yield _sse(opening)
                    sent = dict.fromkeys(range(job.params.n), 0)
                for completion in item.outputs:
                    choice_index = index * job.params.n + completion.index
                    completion = shown(job, completion)
                    generated += len(completion.token_ids)
                    first = choice_index not in sent
                    offset = sent.get(choice_index, 0)
                    chunk = self.shapes.delta(
                        job, index, choice_index, completion, item, first, offset
                    )
                    if chunk is not None:
                        sent[choice_index] = offset + len(chunk.get("text", ""))
                        yield _sse(self.shapes.chunk(job, [chunk]))
            if include_usage:
                body = self.shapes.chunk(job, [])
                body["usage"] = self.shapes.usage(job, generated)
                yield _sse(body)
            yield DONE
        finally:
            await items.aclose()
            for stream in streams:
                stream.close()


async def _merged(
    streams: list[RequestStream],
) -> AsyncIterator[tuple[int, RequestOutput | BaseException]]:
    """(prompt index, output or the error that ended it) from every stream as they come;
    one stream is read directly, without a task in between."""
    if len(streams) == 1:
        try:
            async for output in streams[0]:
                yield 0, output
        except Exception as exc:  # noqa: BLE001 - forwarded to the response
            yield 0, exc
        return
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                await merged.put((index, output))
        except BaseException as exc:  # noqa: BLE001 - forwarded to the response
            await merged.put((index, exc))
        finally:
            await merged.put((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    open_streams = len(tasks)
    try:
        while open_streams:
            index, item = await merged.get()
            if item is None:
                open_streams -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


DONE = b"data: [DONE]\n\n"


def _sse(body: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(body) + b"\n\n"


def _aborted(output: RequestOutput) -> bool:
    return any(c.finish_reason == "abort" for c in output.outputs)


def _error_body(exc: BaseException) -> dict[str, Any]:
    return as_api_error(exc).body()


def _width(num_logprobs: int | None) -> int:
    """Entries a position's logprobs hold: the token and the top N; none when not asked."""
    return 0 if num_logprobs is None else num_logprobs + 1


def _entries(job: Job, finals: list[RequestOutput]) -> int:
    """About how many tokens and logprob entries the body of `finals` holds: what building
    and rendering it costs."""
    width = 1 + (job.num_logprobs or 0)
    prompts = sum(len(output.prompt_token_ids or ()) for output in finals) if job.echo else 0
    generated = sum(len(c.token_ids) for output in finals for c in output.outputs)
    scored = sum(  # prompt_logprobs: per choice on completions
        len(output.outputs) * sum(len(entry or ()) for entry in output.prompt_logprobs)
        for output in finals
        if output.prompt_logprobs is not None
    )
    return (prompts + generated) * width + scored
