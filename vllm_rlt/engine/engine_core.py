"""EngineCore: validate requests, then schedule -> execute -> update, one pass per step."""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field

import torch

from vllm_rlt.attention import get_backend
from vllm_rlt.config import CacheConfig, ExecutionConfig, ExitConfig, SchedulerConfig, require
from vllm_rlt.core.block_pool import KVCacheManager
from vllm_rlt.core.contract import SchedulerOutput
from vllm_rlt.core.memory import MemoryPlan, plan_from_profile, plan_kv_cache
from vllm_rlt.core.request import Request
from vllm_rlt.core.scheduler import Scheduler
from vllm_rlt.engine.output_processor import OutputProcessor
from vllm_rlt.exit import make_exit_policy
from vllm_rlt.outputs import RequestMetrics, RequestOutput
from vllm_rlt.sampling_params import SamplingParams
from vllm_rlt.tokenizer import Tokenizer
from vllm_rlt.worker.model_runner import ModelRunner, PendingPass
from vllm_rlt.worker.pass_inputs import KVGeometry

logger = logging.getLogger(__name__)


@dataclass
class RequestGroup:
    """A user request: its n completions run as separate engine requests."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    arrival_time: float
    finish_reasons: dict[int, str] = field(default_factory=dict)
    error: str | None = None  # why the engine failed this request alone


class EngineCore:
    """Owns the scheduler, the runner and the output processor for one model."""

    def __init__(
        self,
        model,
        tokenizer: Tokenizer | None,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        exit_config: ExitConfig,
        execution_config: ExecutionConfig,
        attention_backend: str = "auto",
    ) -> None:
        cfg = model.config
        self.model = model
        self.tokenizer = tokenizer
        self.cache_config = cache_config
        self.exit_config = exit_config
        self.num_loops = cfg.num_loops
        self.max_model_len = cfg.max_position_embeddings
        self.attention_backend, ops = get_backend(attention_backend, model.device)
        planes = self.num_loops if cache_config.layout == "last_exited" else 1
        self.memory_plan: MemoryPlan = self._plan_memory(
            cache_config, scheduler_config, execution_config, planes, ops
        )
        geometry = KVGeometry(
            planes=planes,
            block_size=cache_config.block_size,
            num_blocks=self.memory_plan.num_blocks,
            write_deeper_planes=cache_config.layout == "last_exited",
        )
        self.kv = KVCacheManager(self.memory_plan.num_blocks, cache_config.block_size)
        self.scheduler = Scheduler(
            scheduler_config, self.kv, self.num_loops, one_position_prefill=planes == 1
        )
        trace_len = self.max_model_len if exit_config.mode == "trace" else 1
        self.runner = ModelRunner(
            model,
            geometry,
            scheduler_config.max_num_seqs,
            self.max_model_len,
            make_exit_policy(exit_config.mode, model, exit_config.seed),
            ops,
            trace_len,
        )
        if execution_config.cuda_graphs and model.device.type == "cuda" and not ops.needs_segments:
            from vllm_rlt.worker.cuda_graphs import DecodeGraphs

            self.runner.graphs = DecodeGraphs(self.runner)
        self.outputs = OutputProcessor(tokenizer)
        self.eos_token_ids = frozenset(cfg.eos_token_ids) | (
            tokenizer.eos_token_ids if tokenizer is not None else frozenset()
        )
        self.groups: dict[str, RequestGroup] = {}
        # no_refill cohorts depend on the previous pass's exits, so they run synchronously.
        self.async_scheduling = (
            execution_config.async_scheduling and scheduler_config.mode == "refill"
        )
        self._in_flight: tuple[SchedulerOutput, PendingPass] | None = None
        self._group_of: dict[str, str] = {}  # engine request id -> user request id
        self._seeds = random.Random(execution_config.seed)
        self.num_passes = 0
        self.num_rows_total = 0  # rows over all passes, for the rows-per-pass metric

    def _plan_memory(self, cache_config, scheduler_config, execution_config, planes, ops):
        cfg, device = self.model.config, self.model.device
        explicit = cache_config.num_blocks is not None or cache_config.kv_cache_memory_bytes
        if device.type != "cuda" or explicit:
            return plan_kv_cache(cache_config, cfg, planes, self.model.dtype)
        from vllm_rlt.worker.memory_profile import peak_pass_bytes

        seqs = scheduler_config.max_num_seqs
        rows = scheduler_config.max_num_batched_tokens
        pass_peak = peak_pass_bytes(self.model, ops, rows, seqs, planes, cache_config.block_size)
        graph_pool = (
            peak_pass_bytes(self.model, ops, seqs, seqs, planes, cache_config.block_size)
            if execution_config.cuda_graphs and not ops.needs_segments
            else 0
        )
        total = torch.cuda.get_device_properties(device).total_memory
        per_seq = -(-self.max_model_len // cache_config.block_size)
        return plan_from_profile(
            cache_config,
            cfg,
            planes,
            self.model.dtype,
            total,
            torch.cuda.memory_allocated(device),
            pass_peak,
            graph_pool,
            seqs * per_seq,
        )

    # ----------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
    ) -> None:
        """Validate and queue a request; any error leaves the engine untouched."""
        request_id = str(request_id)
        require(isinstance(params, SamplingParams), "sampling_params must be a SamplingParams")
        child_ids = (
            [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        )
        for used in [request_id, *child_ids]:
            require(
                used not in self.groups and used not in self._group_of,
                f"request_id {request_id!r} is already in use"
                + ("" if used == request_id else f" (its completion id {used!r} is taken)"),
            )
        min_loops, max_loops, decode_depths = self.check_request(
            request_id, prompt_token_ids, params
        )
        threshold = params.exit_threshold
        if threshold is None:
            threshold = self.model.config.early_exit_threshold
        now = time.monotonic()
        children = []
        for index, child_id in enumerate(child_ids):
            if params.seed is None:
                seed = self._seeds.getrandbits(63)
            else:
                seed = (params.seed + index) % 2**63
            children.append(
                Request(
                    request_id=child_id,
                    prompt_token_ids=list(prompt_token_ids),
                    params=params,
                    min_loops=min_loops,
                    max_loops=max_loops,
                    exit_threshold=float(threshold),
                    seed=seed,
                    decode_depths=decode_depths,
                    eos_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids,
                    stop_token_ids=frozenset(params.stop_token_ids),
                    arrival_time=now,
                )
            )
        self.groups[request_id] = RequestGroup(
            request_id, prompt, list(prompt_token_ids), children, now
        )
        for child in children:
            self._group_of[child.request_id] = request_id
            self.outputs.add(child)
            self.scheduler.add_request(child)

    def check_request(
        self, request_id: str, prompt: list[int], params: SamplingParams
    ) -> tuple[int, int, tuple[int, ...] | None]:
        """Every check that depends only on configuration (so another thread may call it):
        returns (min_loops, max_loops, trace depths of the decode inputs or None)."""
        require(isinstance(params, SamplingParams), "sampling_params must be a SamplingParams")
        self._validate(prompt, params)
        min_loops, max_loops = params.resolved_loops(self.num_loops)
        return min_loops, max_loops, self._trace_for(request_id, params, min_loops, max_loops)

    def _validate(self, prompt: list[int], params: SamplingParams) -> None:
        require(
            isinstance(prompt, (list, tuple)) and len(prompt) > 0,
            "prompt must contain at least one token",
            "prompt",
        )
        vocab = self.model.config.vocab_size
        for token in prompt:
            require(
                isinstance(token, int) and not isinstance(token, bool) and 0 <= token < vocab,
                f"prompt_token_ids entries must be integers in [0, {vocab - 1}], got {token!r}",
                "prompt",
            )
        for token in params.stop_token_ids:
            require(
                token < vocab,
                f"stop_token_ids entries must be in [0, {vocab - 1}], got {token}",
                "stop_token_ids",
            )
        total = len(prompt) + params.max_tokens
        require(
            total <= self.max_model_len,
            f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {total} "
            f"exceeds the model's context length {self.max_model_len}",
            "max_tokens",
        )
        needed = self.kv.blocks_for(len(prompt) + params.max_tokens - 1)
        require(
            needed <= self.kv.num_blocks,
            f"prompt + max_tokens needs {needed} KV blocks but the cache has "
            f"{self.kv.num_blocks}; lower max_tokens or raise num_blocks",
            "max_tokens",
        )
        params.resolved_loops(self.num_loops)

    def _trace_for(
        self, request_id: str, params: SamplingParams, min_loops: int, max_loops: int
    ) -> tuple[int, ...] | None:
        if self.exit_config.mode != "trace":
            return None
        depths = self.exit_config.depths_by_request.get(request_id)
        require(depths is not None, f"exit trace has no depths for request_id {request_id!r}")
        require(
            depths[0] == self.num_loops,
            f"exit trace for {request_id!r}: the first depth is the prefill depth and must be "
            f"{self.num_loops}, got {depths[0]}",
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
        return tuple(depths[1:])

    def abort_request(self, request_id: str, index: int | None = None) -> RequestOutput | None:
        """Stop a request (or only its completion `index`) at any time; blocks and slots
        are freed at once."""
        group = self.groups.get(str(request_id))
        if group is None:
            return None
        for position, child in enumerate(group.children):
            if index is not None and position != index:
                continue
            if not child.is_finished:
                self.scheduler.finish(child, "abort")
                group.finish_reasons[position] = "abort"
        output = self._finalize(group)
        self._drain_if_idle()
        return output

    @property
    def has_unfinished(self) -> bool:
        return bool(self.groups) or self._in_flight is not None

    def leave_text_to_caller(self) -> None:
        """Stop detokenizing here (and so checking stop strings): the caller turns tokens
        into text on its own thread. Only valid before any request was added."""
        require(not self.groups, "leave_text_to_caller must come before the first request")
        self.outputs = OutputProcessor(self.tokenizer, make_text=False)

    # ----------------------------------------------------------------- one step
    def step(self) -> list[RequestOutput]:
        """Run one pass; return an output for every group that progressed.

        With asynchronous scheduling the pass launched here is collected by the next step:
        the host plans and launches pass k+1 before it processes pass k's tokens. A failure
        while handling one request's state (its admission, its tokens) fails that request
        alone; its output carries the error.
        """
        launched = None
        failed: list[tuple[Request, BaseException]] = []
        if self.scheduler.has_unfinished:
            scheduled = self.scheduler.schedule()
            failed = self._admit(scheduled.new_slots)
            if not scheduled.is_empty:
                launched = (scheduled, self.runner.launch(scheduled))
                self.num_passes += 1
                self.num_rows_total += scheduled.num_rows
            elif self._in_flight is None:
                # Admission validated every reservation against the pool, so an idle pass
                # with work queued means a scheduler invariant broke: fail, do not spin.
                raise RuntimeError("scheduler produced an empty pass while requests wait")
        if not self.async_scheduling:
            ready, self._in_flight = launched, None
        else:
            ready, self._in_flight = self._in_flight, launched
        progressed: dict[str, RequestGroup] = {}
        for request, error in failed:
            # Its rows in the pass just launched only write to the dummy block, and their
            # results are dropped: the request no longer owns its slot when they arrive.
            group = self._fail(request, error)
            progressed[group.request_id] = group
        if ready is not None:
            scheduled, pending = ready
            touched = self.scheduler.update(scheduled, self.runner.collect(pending))
            now = time.monotonic()
            for request in touched:
                if request.is_finished:
                    continue  # a sibling's failure ended its group within this loop
                if request.first_token_time is None:
                    request.first_token_time = now
                group = self.groups[self._group_of[request.request_id]]
                try:
                    reason = self.outputs.process(request)
                except Exception as exc:  # noqa: BLE001 - fails this request only
                    progressed[group.request_id] = self._fail(request, exc)
                    continue
                if reason is not None:
                    self.scheduler.finish(request, reason)
                    group.finish_reasons[group.children.index(request)] = reason
                progressed[group.request_id] = group
        outputs = [self._finalize(group) for group in progressed.values()]
        self._drain_if_idle()
        return outputs

    def _admit(self, new_slots) -> list[tuple[Request, BaseException]]:
        """Write each newly admitted request's slot; the requests whose admission failed."""
        failed = []
        for new in new_slots:
            try:
                self.runner.admit(new)
            except Exception as exc:  # noqa: BLE001 - fails this request only
                failed.append((self.scheduler.running[new.slot], exc))
        return failed

    def _fail(self, request: Request, error: BaseException) -> RequestGroup:
        """End a request's whole group (its completions share one prompt) with the error."""
        group = self.groups[self._group_of[request.request_id]]
        logger.error(
            "request %s failed; the engine keeps running",
            group.request_id,
            exc_info=(type(error), error, error.__traceback__),
        )
        for index, child in enumerate(group.children):
            if not child.is_finished:
                self.scheduler.finish(child, "abort")
                group.finish_reasons[index] = "abort"
        group.error = f"{type(error).__name__}: {error}"
        return group

    def _drain_if_idle(self) -> None:
        """With nothing left to run, the pass still in flight only holds rows of finished
        requests: wait for it so an idle engine has nothing outstanding."""
        if self._in_flight is not None and not self.scheduler.has_unfinished:
            self.runner.collect(self._in_flight[1])
            self._in_flight = None

    def _finalize(self, group: RequestGroup) -> RequestOutput:
        completions = [
            self.outputs.completion(child, index, group.finish_reasons.get(index))
            for index, child in enumerate(group.children)
        ]
        finished = len(group.finish_reasons) == len(group.children)
        first_times = [c.first_token_time for c in group.children if c.first_token_time]
        depths = [d for c in group.children for d in c.exit_depths[1:]]
        metrics = RequestMetrics(
            arrival_time=group.arrival_time,
            first_token_time=min(first_times) if first_times else None,
            finished_time=time.monotonic() if finished else None,
            time_to_first_token=(min(first_times) - group.arrival_time) if first_times else None,
            mean_loops_per_token=sum(depths) / len(depths) if depths else None,
        )
        if finished:
            del self.groups[group.request_id]
            for child in group.children:
                self.outputs.drop(child.request_id)
                del self._group_of[child.request_id]
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=metrics,
            error=group.error,
        )

    def all_blocks_free(self) -> bool:
        return self.kv.all_free() and not self.scheduler.running and self._in_flight is None
