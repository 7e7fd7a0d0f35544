"""AsyncLLM: the frontend of the engine. The engine core runs in its own process (or, for
tests, a thread) behind an `EngineCoreClient`; this side validates requests, turns tokens
into text, applies stop strings, and hands each caller its outputs.

Engine messages are read by a task of the event loop (one wakeup per engine step, whatever
the number of requests in it), and a stream that is read slower than tokens arrive gets
them merged into one output.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

from vllm_rlt.config import ExitConfig, require
from vllm_rlt.engine.core_outputs import CoreStats, EngineStats
from vllm_rlt.engine.input_processor import InputProcessor
from vllm_rlt.engine.process.core_client import CoreAttachment, EngineCoreClient
from vllm_rlt.engine.process.dp_client import DataParallelClient, RemoteCores
from vllm_rlt.engine.process.messages import AbortAll, AbortRequest, AddRequest, EngineOutputs
from vllm_rlt.engine.process.pd_client import DisaggregatedClient
from vllm_rlt.engine.request_checks import RequestChecker, RequestLimits
from vllm_rlt.engine.request_stream import RequestStream
from vllm_rlt.engine.rl_calls import GenerationPause, RLCalls
from vllm_rlt.models.load import load_tokenizer, model_sampling_defaults
from vllm_rlt.outputs import RequestOutput
from vllm_rlt.sampling_params import SamplingParams
from vllm_rlt.tokenizer import Tokenizer
from vllm_rlt.tokenizer.hf_compat import user_tokenizer

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


class AsyncLLM(RLCalls):
    """Starts the engine core and serves asyncio callers; nothing here blocks the event
    loop. `in_process=True` runs the core on a thread of this process instead (tests use it
    to reach into the engine); the messages are the same.

    `attach` joins cores that another process started (one of several API servers), one
    attachment per data-parallel rank; `llm_kwargs` then only names the model, for its
    tokenizer. `data_parallel_size` N > 1
    starts N cores (one per GPU) and places each request on the least loaded one;
    `remote_cores` says which of them connect from other hosts. `disaggregate` (P, D)
    starts P prefill and D decode cores (engine/process/pd_client.py).

    `max_waiting` bounds the sequences (completions) that wait for a slot: a request is
    refused when it would raise this frontend's sequences above `max_num_seqs +
    max_waiting`, and refused for good when it alone exceeds that.
    """

    def __init__(
        self,
        llm_kwargs: dict[str, Any],
        max_waiting: int | None = None,
        observer: StepObserver | None = None,
        in_process: bool = False,
        attach: list[CoreAttachment] | None = None,
        data_parallel_size: int = 1,
        remote_cores: RemoteCores | None = None,
        generation_config: str = "auto",
        generation_config_ignore_invalid: bool = False,
        disaggregate: tuple[int, int] | None = None,
        kv_connector: str = "auto",
    ) -> None:
        self.max_waiting = max_waiting
        self.observer = observer
        self.dead: BaseException | None = None
        self.last_progress = time.monotonic()
        self.num_sequences = 0  # completions of the open streams
        self.stats: EngineStats | None = None  # as of the latest engine step
        self.weight_version: str | None = None  # of the latest update that gave one
        self._streams: dict[str, RequestStream] = {}
        model = llm_kwargs.get("model")
        self._user_tokenizer: Any = None  # get_tokenizer's, made on first use
        self.tokenizer: Tokenizer | None = load_tokenizer(
            model, llm_kwargs.get("tokenizer"), llm_kwargs.get("skip_tokenizer_init", False)
        )
        # what a request leaves unset (vLLM's generation_config: the model's file by default)
        sampling_defaults = model_sampling_defaults(
            model, generation_config, strict=not generation_config_ignore_invalid
        )
        self._loop: asyncio.AbstractEventLoop | None = None  # the one that reads outputs
        self.client: EngineCoreClient | DataParallelClient
        if attach is not None:
            require(len(attach) == data_parallel_size, "one attachment per data-parallel rank")
            if data_parallel_size == 1:
                self.client = EngineCoreClient.attach(attach[0], self._on_death)
            else:
                self.client = DataParallelClient.attach(attach, self._on_death, self._on_core_lost)
        elif disaggregate is not None:
            self.client = DisaggregatedClient(
                llm_kwargs,
                self._on_death,
                *disaggregate,
                in_process,
                self._on_core_lost,
                kv_connector,
            )
        elif data_parallel_size > 1 or remote_cores is not None:
            self.client = DataParallelClient(
                llm_kwargs,
                self._on_death,
                data_parallel_size,
                in_process,
                remote_cores,
                on_core_lost=self._on_core_lost,
            )
        else:
            self.client = EngineCoreClient(llm_kwargs, self._on_death, in_process)
        self.pause = GenerationPause(
            self, shared=bool(attach or getattr(self.client, "attachments", None))
        )
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
            llm_kwargs.get("exit_config") or ExitConfig(),
        )
        self.processor = InputProcessor(
            self.tokenizer, checker, sampling_defaults, frozenset(info.eos_token_ids)
        )

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

    def lost_cores(self) -> str | None:
        """Which data-parallel cores are gone while others serve on, or None."""
        if isinstance(self.client, DataParallelClient):
            return self.client.lost_reason()
        return None

    def stalled(self, timeout: float) -> str | None:
        """Why the engine counts as stalled (work waits and no pass completed for `timeout`
        seconds; with several cores, on any one of them), or None. Paused, none runs."""
        if self.pause.paused:
            return None
        if isinstance(self.client, DataParallelClient):
            rank = self.client.stalled_rank(timeout)
            return (
                None if rank is None else f"engine core {rank} made no progress for {timeout:g} s"
            )
        if self.has_work and time.monotonic() - self.last_progress > timeout:
            return f"no pass completed for {timeout:g} s"
        return None

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
        if not self.pause.hold(command):
            self.client.send(command)
        return stream

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the outputs of one request, in `params.output_kind`; leaving early aborts
        it."""
        stream = self.add_request(request_id, prompt_token_ids, params, prompt)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Abort a request (all its completions: any id a caller gave), or only its
        completion `index`."""
        if not self.pause.drop(request_id, index):
            self.client.send(AbortRequest(request_id, index))

    def abort_all(self) -> None:
        """End every request now: each stream gets a final output with finish reason abort."""
        self.pause.drop_all()
        self.client.send(AbortAll(self.client.client))

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
        if self._streams.get(stream.request_id) is stream:
            del self._streams[stream.request_id]
            self.num_sequences -= stream.params.n
        if not stream.engine_done:
            self.abort(stream.request_id)

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
        self.last_progress = now
        self.stats = outputs.stats
        if self.observer is not None:
            try:
                self.observer.observe_step(outputs)
            except Exception:  # noqa: BLE001
                logger.exception("metrics observer failed; the engine keeps running")
        streams = self._streams
        for delta in outputs.requests:
            stream = streams.get(delta.request_id)
            if stream is not None:
                stream.absorb(delta, now)

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
        assert isinstance(self.client, DataParallelClient)
        error = EngineDeadError(f"engine core {rank} (of {self.client.size}): {reason}")
        for request_id in self.client.forget_core(rank):
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.fail(error)

    def _fail_streams(self) -> None:
        for stream in list(self._streams.values()):
            stream.fail(self.dead)  # type: ignore[arg-type]
