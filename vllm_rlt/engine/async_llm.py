"""AsyncLLM: the frontend of the engine. The engine core runs in its own process (or, for
tests, a thread) behind an `EngineCoreClient`; this side validates requests, turns tokens
into text, applies stop strings, and hands each caller its outputs.

Engine messages are read by a task of the event loop (one wakeup per engine step, whatever
the number of requests in it), and a stream that is read slower than tokens arrive gets
them merged into one output.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any, Protocol

from vllm_rlt.config import SERVE, ParamError, require
from vllm_rlt.engine.core_outputs import CoreStats, EngineStats
from vllm_rlt.engine.engine_args import EngineArgs
from vllm_rlt.engine.held_commands import HeldCommands
from vllm_rlt.engine.input_processor import InputProcessor
from vllm_rlt.engine.process.clients import make_client
from vllm_rlt.engine.process.core_client import CoreAttachment
from vllm_rlt.engine.process.dp_client import RemoteCores
from vllm_rlt.engine.process.messages import AbortAll, AbortRequest, AddRequest, EngineOutputs
from vllm_rlt.engine.request_checks import RequestChecker, RequestLimits
from vllm_rlt.engine.request_stream import RequestStream
from vllm_rlt.engine.rl_calls import Answered, GenerationPause, WeightCalls
from vllm_rlt.engine.weight_sync import DEFAULT_GROUP_NAME
from vllm_rlt.engine_config import EngineConfig
from vllm_rlt.inputs import PromptType, prompt_parts
from vllm_rlt.models.load import load_tokenizer, model_sampling_defaults
from vllm_rlt.outputs import RequestOutput
from vllm_rlt.sampling_params import SamplingParams
from vllm_rlt.tokenizer import Tokenizer
from vllm_rlt.tokenizer.hf_compat import user_tokenizer
from vllm_rlt.tokenizer.tokenizer import GIL_FREE_CHARS, require_valid_text

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core stopped; no request can run any more."""


class QueueFullError(RuntimeError):
    """The bounded waiting queue is full."""


class StepObserver(Protocol):
    """What the metrics implement: engine steps and finished requests (on the event
    loop)."""

    def observe_step(self, outputs: EngineOutputs) -> None: ...

    def observe_finished(self, output: RequestOutput) -> None: ...


def _unsendable(exc: Exception) -> ParamError:
    """A request the wire cannot carry (a SamplingParams edited after it was checked)."""
    return ParamError(f"the request could not be sent to the engine: {exc}")


class AsyncLLM:
    """Starts the engine core and serves asyncio callers; nothing here blocks the event
    loop. `in_process=True` runs the core on a thread of this process instead (tests use it
    to reach into the engine); the messages are the same.

    `config.parallel_config` says which cores serve (engine/process/clients.py): one, its
    `data_parallel_size` N > 1 (one per GPU; each request on the least loaded one), or its
    `disaggregate` (P, D) prefill and decode cores (engine/process/pd_client.py);
    `remote_cores` says which data-parallel cores connect from other hosts. `attach` joins
    cores that another process started (one of several API servers), one attachment per
    data-parallel rank; the config then serves for the tokenizer and the request checks.

    `max_waiting` bounds the sequences (completions) that wait for a slot: a request is
    refused when it would raise this frontend's sequences above `max_num_seqs +
    max_waiting`, and refused for good when it alone exceeds that.

    An RL trainer's calls (pause, resume, weight updates) are handed to `pause` and
    `weights` (engine/rl_calls.py).
    """

    def __init__(
        self,
        config: EngineConfig,
        max_waiting: int | None = None,
        observer: StepObserver | None = None,
        in_process: bool = False,
        attach: list[CoreAttachment] | None = None,
        remote_cores: RemoteCores | None = None,
    ) -> None:
        self.config = config
        self.max_waiting = max_waiting
        self.observer = observer
        self.dead: BaseException | None = None
        self.num_sequences = 0  # completions of the open streams
        self.stats: EngineStats | None = None  # as of the latest engine step
        self._streams: dict[str, RequestStream] = {}
        # streams their readers left, until the core's last delta for each says it holds
        # nothing of it (a pause waits for that); a new request of the same id waits here
        # until then (see engine/held_commands.py)
        self._leaving: dict[str, RequestStream] = {}
        self._after_leaving = HeldCommands()
        model_config = config.model_config
        self._user_tokenizer: Any = None  # get_tokenizer's, made on first use
        self.tokenizer: Tokenizer | None = load_tokenizer(
            model_config.model, model_config.tokenizer, model_config.skip_tokenizer_init
        )
        # what a request leaves unset (vLLM's generation_config: the model's file by default)
        sampling_defaults = model_sampling_defaults(
            model_config.model,
            model_config.generation_config,
            strict=not model_config.generation_config_ignore_invalid,
        )
        self._loop: asyncio.AbstractEventLoop | None = None  # the one that reads outputs
        self.client = make_client(
            config,
            self._on_death,
            self._on_core_lost,
            in_process=in_process,
            remote_cores=remote_cores,
            attach=attach,
        )
        # other API servers feed the cores this one joined
        self.pause = GenerationPause(self, shared=attach is not None)
        self.weights = WeightCalls(self.client)
        info = self.client.info
        self.info = info
        self.model_name = info.model_name
        self.max_model_len = info.max_model_len
        self.max_running = info.max_num_seqs
        checker = RequestChecker(
            RequestLimits(
                vocab_size=info.vocab_size,
                max_model_len=info.max_model_len,
                num_blocks=info.num_blocks,
                block_size=info.block_size,
                num_loops=info.num_loops,
                scheduling_policy=info.scheduling_policy,
                prompt_tables=info.prompt_tables,
            ),
            config.exit_config,
        )
        self.processor = InputProcessor(
            self.tokenizer, checker, sampling_defaults, frozenset(info.eos_token_ids)
        )

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> AsyncLLM:
        """vLLM's constructor: the engine `engine_args` describe, sized for serving unless
        they say otherwise (`usage_context`); `kwargs` as for `AsyncLLM`."""
        if engine_args.usage_context is None:
            engine_args = dataclasses.replace(engine_args, usage_context=SERVE)
        return cls(engine_args.create_engine_config(), **kwargs)

    # ----------------------------------------------------------------- caller side
    async def get_tokenizer(self) -> Any:
        """vLLM's: the model's tokenizer as `LLM.get_tokenizer` gives it (transformers'
        `PreTrainedTokenizerFast`, or its compatible subset); ValueError without one."""
        require(self.tokenizer is not None, "this engine has no tokenizer", "tokenizer")
        if self._user_tokenizer is None:
            self._user_tokenizer = user_tokenizer(self.tokenizer)  # type: ignore[arg-type]
        return self._user_tokenizer

    @property
    def has_work(self) -> bool:
        return bool(self._streams)

    @property
    def num_requests(self) -> int:
        """Requests whose streams are open (queued or running)."""
        return len(self._streams)

    @property
    def weight_version(self) -> str | None:
        """The tag of the latest weight update that gave one."""
        return self.weights.version

    def lost_cores(self) -> str | None:
        """Which data-parallel cores are gone while others serve on, or None."""
        return self.client.lost_reason()

    def stalled(self, timeout: float) -> str | None:
        """Why the engine counts as stalled (work waits and no pass completed for `timeout`
        seconds; with several cores, on any one of them), or None. Paused, none runs."""
        if self.pause.paused:
            return None
        return self.client.stalled(timeout, self.has_work)

    def check_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        """Every check the core makes on arrival: bad input raises ParamError here."""
        self.processor.process(request_id, prompt, params)

    def check_capacity(self, sequences: int) -> None:
        """Refuse `sequences` more completions: for good (ParamError) when they could never
        fit, for now (QueueFullError) when the queue is full."""
        if self.max_waiting is None:
            return
        capacity = self.max_running + self.max_waiting
        require(
            sequences <= capacity,
            f"the request needs {sequences} sequences (prompts x n) but the server holds at "
            f"most {capacity}: {self.max_running} running (--max-num-seqs) and "
            f"{self.max_waiting} waiting (--max-queue)",
            "n",
        )
        if self.num_sequences + sequences > capacity:
            raise QueueFullError(
                f"the waiting queue is full ({self.max_waiting} sequences wait for "
                f"{self.max_running} slots); retry later"
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
    ) -> RequestStream:
        """Queue a request now and return its stream (call it from the event loop)."""
        if self.dead is not None:
            raise EngineDeadError(str(self.dead))
        self._read_outputs_here()
        require(request_id not in self._streams, f"request_id {request_id!r} is already in use")
        self.check_capacity(params.n)
        prompt_token_ids, params = self.processor.prepare(prompt_token_ids, params)
        stream = RequestStream(self, request_id, prompt, list(prompt_token_ids), params)
        self._streams[request_id] = stream
        self.num_sequences += params.n
        command = AddRequest(request_id, stream.prompt_token_ids, params, self.client.client)
        try:
            if request_id in self._leaving or self.client.holds(request_id):
                self._after_leaving.hold(command)
            else:
                self._send(command)
        except (ValueError, OverflowError, TypeError) as exc:  # it could not be encoded
            self._streams.pop(request_id, None)
            self.num_sequences -= params.n
            raise _unsendable(exc) from exc
        return stream

    async def generate(
        self, prompt: PromptType, sampling_params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """vLLM's call: stream the outputs of one request, in `sampling_params.output_kind`;
        leaving early aborts it. `prompt` is a text, token ids, a `TextPrompt` or a
        `TokensPrompt` (its token ids win over its text, which outputs then carry)."""
        require_valid_text(request_id, "request_id")  # the core's messages carry a str
        text, token_ids = prompt_parts(prompt)
        keep = getattr(sampling_params, "truncate_prompt_tokens", None)
        if token_ids is None and isinstance(text, str) and len(text) > GIL_FREE_CHARS:
            # a long text on a worker thread, the GIL released: the loop serves the others
            token_ids = await asyncio.to_thread(self.processor.encode, text, True, keep)
        elif token_ids is None:
            token_ids = self.processor.encode(text, truncate_prompt_tokens=keep)  # type: ignore[arg-type]
        # every check the core makes, here: a value the core could not even decode (a
        # SamplingParams edited after it was made) must not reach it
        self.check_request(request_id, token_ids, sampling_params)
        stream = self.add_request(request_id, token_ids, sampling_params, text)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def abort(self, request_id: str | Iterable[str], index: int | None = None) -> Answered:
        """Abort a request (all its completions: any id a caller gave), or only its
        completion `index`; or each of several ids. Done at once; vLLM's `await
        engine.abort(...)` works on the answer too."""
        several = not isinstance(request_id, str) and isinstance(request_id, Iterable)
        ids = list(request_id) if several else [request_id]
        for one in ids:  # all checked before any is aborted
            require_valid_text(one, "request_id")  # the core's messages carry a str
        require(
            index is None or (type(index) is int and 0 <= index < 2**31),
            f"index must be None or a completion index in [0, 2^31), got {index!r}",
            "index",
        )
        for one in ids:
            if not self._after_leaving.drop(one, index, self._streams.get(one)):
                if not self.pause.drop(one, index):
                    self.client.send(AbortRequest(one, index))
        return Answered(None)

    def abort_all(self) -> None:
        """End every request now: each stream gets a final output with finish reason abort,
        and a caller waiting for a join of the trainer's group gets EngineDeadError."""
        self.pause.drop_all()
        self._after_leaving.drop_all(self._streams.get)
        self.client.send(AbortAll(self.client.client))
        self.weights.leave(EngineDeadError("the server is shutting down: the join was left"))

    def engine_stats(self, timeout: float = 30.0) -> CoreStats:
        """The core's own view, asked over the control channel: requests, free blocks and
        slots, passes (blocks the calling thread until the core answers)."""
        stats = self.client.call("stats", timeout)
        assert isinstance(stats, CoreStats)
        return stats

    def memory_call(self, name: str, timeout: float = 120.0) -> dict[str, bool | str]:
        """A sleep-mode call to every core ("sleep_1", "sleep_2", "wake_up[:TAGS]", "is_sleeping",
        "reset_prefix_cache"); blocks the calling thread until they answer."""
        answer = self.client.call(name, timeout)
        assert isinstance(answer, dict)
        return answer

    def shutdown(self) -> None:
        self.client.shutdown()

    def observe_finished(self, output: RequestOutput) -> None:
        if self.observer is None:
            return
        try:
            self.observer.observe_finished(output)
        except Exception:  # noqa: BLE001
            logger.exception("metrics observer failed; the engine keeps running")

    def release(self, stream: RequestStream) -> None:
        request_id = stream.request_id
        if self._streams.get(request_id) is stream:
            del self._streams[request_id]
            self.num_sequences -= stream.params.n
        if stream.engine_done or self._after_leaving.drop(request_id, None, None):
            return
        if self.pause.drop(request_id, None):  # drop: never sent
            return
        self._leaving[request_id] = stream
        self.client.send(AbortRequest(request_id, None))

    def streams_in_cores(self) -> list[RequestStream]:
        """Every stream whose request a core may hold: those sent (not held back here), and
        those whose readers left until the core answers their abort."""
        held = self.pause.held.ids() | self._after_leaving.ids()
        sent = [stream for request_id, stream in self._streams.items() if request_id not in held]
        return sent + list(self._leaving.values())

    def _send(self, command: AddRequest | AbortRequest) -> None:
        """To the cores, unless a pause holds it back."""
        if not self.pause.hold(command):
            self.client.send(command)

    def send_held(self, command: AddRequest | AbortRequest) -> None:
        """A command held back, sent now: one the wire cannot carry fails its own stream."""
        try:
            self._send(command)
        except (ValueError, OverflowError, TypeError) as exc:  # it could not be encoded
            stream = self._streams.get(command.request_id)
            if stream is not None:
                stream.fail(_unsendable(exc))

    def _send_released(self) -> None:
        """Send the requests that waited for their id to be free: no stream its reader
        left holds it in a core, and the client keeps no record of it."""
        for request_id in self._after_leaving.ids():
            if request_id not in self._leaving and not self.client.holds(request_id):
                for command in self._after_leaving.take(request_id):
                    self.send_held(command)

    # ----------------------------------------------------------------- RL trainer calls
    async def pause_generation(self, mode: str = "abort") -> None:
        """vLLM's pause: "abort" (the default) ends what is in flight with finish reason
        abort, "wait" lets it finish, "keep" freezes it until `resume_generation`. New
        requests wait until then; a weight update may run in between."""
        await self.pause.pause(mode)

    async def resume_generation(self) -> None:
        await self.pause.resume()

    def is_paused(self) -> Answered:
        """Whether generation is paused: true or false at once, or awaited (vLLM's is a
        coroutine)."""
        return Answered(self.pause.paused)

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = DEFAULT_GROUP_NAME,
        backend: str | None = None,
    ) -> None:
        """The engine core joins the trainer's group as rank `rank_offset` (see
        engine/weight_sync.py); returns once every rank has joined."""
        await self.weights.call(
            "init_weights_update_group",
            {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": rank_offset,
                "world_size": world_size,
                "group_name": group_name,
                "backend": backend,
            },
        )

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        weight_version: str | None = None,
    ) -> None:
        """Take the tensors the trainer broadcasts; the engine must be idle or paused. A wrong
        name, dtype or shape is a ValueError with nothing changed."""
        args = {"names": names, "dtypes": dtypes, "shapes": shapes}
        await self.weights.call("update_weights_from_distributed", args, weight_version)

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None
    ) -> None:
        """Copy a checkpoint folder's weights in place (same names and shapes)."""
        await self.weights.call(
            "update_weights_from_disk", {"model_path": model_path}, weight_version
        )

    # ----------------------------------------------------------------- engine outputs
    def _read_outputs_here(self) -> None:
        """Engine outputs are read on the event loop of the first request, and all requests
        must come from that loop (one frontend serves one loop)."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
            self.client.start_reading(self._on_outputs)
        elif self._loop is not loop:
            raise RuntimeError("AsyncLLM serves the event loop of its first request only")

    def _on_outputs(self, outputs: EngineOutputs) -> None:
        """One engine step, on the event loop: metrics, then each stream's new tokens."""
        now = time.monotonic()
        self.stats = outputs.stats
        if self.observer is not None:
            try:
                self.observer.observe_step(outputs)
            except Exception:  # noqa: BLE001
                logger.exception("metrics observer failed; the engine keeps running")
        streams, leaving = self._streams, self._leaving
        for delta in outputs.requests:
            left = leaving.get(delta.request_id)
            if left is not None:  # its reader is gone; a new request of its id waits
                if delta.finished:
                    left.state.engine_done = True
                    del leaving[delta.request_id]
                continue
            stream = streams.get(delta.request_id)
            if stream is not None:
                stream.absorb(delta, now)
        if self._after_leaving.commands:
            self._send_released()

    def _on_death(self, reason: str) -> None:
        """The core is gone (any thread): every open stream fails."""
        logger.error("%s; every request in flight fails, restart the server", reason)
        self.dead = EngineDeadError(reason)
        self._on_loop(self._fail_streams)

    def _on_core_lost(self, rank: int, reason: str) -> None:
        """One data-parallel core is gone and others run (any thread): only the streams of
        its requests fail."""
        logger.error(
            "engine core %d died (%s); its requests fail, the other cores serve on", rank, reason
        )
        self._on_loop(self._fail_core_streams, rank, reason)

    def _on_loop(self, callback, *args) -> None:
        """Run `callback` on the event loop that reads outputs (from any thread), if any."""
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the event loop has closed: nobody is listening
            pass

    def _fail_core_streams(self, rank: int, reason: str) -> None:
        error = EngineDeadError(f"engine core {rank} (of {self.client.size}): {reason}")
        for request_id in self.client.forget_core(rank):
            left = self._leaving.pop(request_id, None)
            if left is not None:  # a newer request of its id never reached that core
                left.fail(error)
                continue
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.fail(error)
        self._send_released()  # those that waited for the lost core go to another

    def _fail_streams(self) -> None:
        leaving = list(self._leaving.values())
        self._leaving.clear()
        self._after_leaving.take()
        for stream in [*self._streams.values(), *leaving]:
            stream.fail(self.dead)  # type: ignore[arg-type]
