"""What the server's routes share: the engine, loaded in the background, and whether it
loaded; the serving and metrics built on it."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from vllm_rlt.engine.async_llm import AsyncLLM
from vllm_rlt.engine.process.core_client import CoreAttachment
from vllm_rlt.entrypoints.openai.api_errors import APIError
from vllm_rlt.entrypoints.openai.metrics import ServerMetrics
from vllm_rlt.entrypoints.openai.request_jobs import RequestJobs
from vllm_rlt.entrypoints.openai.serving import OpenAIServing
from vllm_rlt.entrypoints.openai.settings import ServerSettings

logger = logging.getLogger("vllm_rlt.server")


def _cores(settings: ServerSettings) -> str:
    """The engine cores behind this server, in words."""
    parallel = settings.engine_config.parallel_config
    if parallel.disaggregate is not None:
        prefill, decode = parallel.disaggregate
        return f"{prefill} prefill and {decode} decode engine cores"
    if parallel.data_parallel_size > 1:
        return f"{parallel.data_parallel_size} data-parallel engine cores"
    return "the engine core"


class ServerState:
    """What the routes need; filled in once the model has loaded (in the background)."""

    def __init__(
        self, settings: ServerSettings, attach: list[CoreAttachment] | None = None
    ) -> None:
        self.settings = settings
        # Join the cores another process started, one per data-parallel rank (this is one
        # of several API servers).
        self.attach = attach
        self.engine: AsyncLLM | None = None
        self.serving: OpenAIServing | None = None
        self.metrics: ServerMetrics | None = None
        self.load_error: BaseException | None = None
        self.on_load_error: Callable[[], None] | None = None

    def load(self) -> None:
        try:
            engine = AsyncLLM(
                self.settings.engine_config,
                self.settings.max_queue,
                in_process=self.settings.engine_in_process,
                attach=self.attach,
                remote_cores=self.settings.remote_cores,
            )
            name = self.settings.served_model_name or engine.model_name
            index = self.attach[0].client if self.attach is not None else 1
            metrics = ServerMetrics(engine.info.num_loops, name, index)
            engine.observer = metrics
            jobs = RequestJobs(
                engine,
                engine.tokenizer,
                name,
                self.settings.max_sequences_per_request,
                self.settings.max_logprobs_per_request,
            )
            self.serving = OpenAIServing(jobs, self.settings.request_timeout)
            self.metrics, self.engine = metrics, engine
            if self.attach is not None:
                logger.info(
                    "API server %d of %d ready (pid %d)",
                    self.attach[0].client,
                    self.settings.api_server_count,
                    os.getpid(),
                )
                return
            pids = ", ".join(str(process.pid) for process in engine.client.processes)
            logger.info(
                "model %s loaded (%s, %d KV blocks) in %s%s%s; ready",
                name,
                engine.info.device,
                engine.info.num_blocks,
                _cores(self.settings),
                f" (pid {pids})" if pids else "",
                f", K/V through {engine.client.kv_connector}"
                if self.settings.engine_config.parallel_config.disaggregate is not None
                else "",
            )
            logger.info("%s", engine.info.scheduler_note)
        except BaseException as exc:  # reported by /health and every route
            self.load_error = exc
            user_error = isinstance(exc, (ValueError, OSError))  # the message says it all
            if self.on_load_error is None or not user_error:
                logger.error(
                    "the model failed to load: %s",
                    exc,
                    exc_info=None if user_error else exc,
                )
            if self.on_load_error is not None:
                self.on_load_error()

    def ready(self) -> OpenAIServing:
        if self.load_error is not None:
            raise APIError(503, f"model failed to load: {self.load_error}", "service_unavailable")
        if self.serving is None:
            raise APIError(503, "the model is still loading", "service_unavailable")
        return self.serving

    def loaded_engine(self) -> AsyncLLM:
        """The engine once loaded (APIError 503 before)."""
        self.ready()
        assert self.engine is not None
        return self.engine

    def abort_all(self) -> int:
        """End every request now (shutdown); how many there were."""
        if self.serving is None or self.engine is None:
            return 0
        self.serving.closing = True
        running = self.engine.num_requests
        self.engine.abort_all()
        return running
