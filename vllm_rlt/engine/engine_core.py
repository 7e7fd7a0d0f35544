"""EngineCore: validate requests, then schedule -> execute -> update, one pass per step."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

import torch

from vllm_rlt.config import CacheConfig, ExecutionConfig, SpeculativeConfig, require
from vllm_rlt.core.memory import MemoryPlan
from vllm_rlt.core.request import Request
from vllm_rlt.core.scheduler import Scheduler
from vllm_rlt.engine.core_outputs import EngineStats, RequestDelta
from vllm_rlt.engine.disagg.handover import HandoverLedger, KVHandover
from vllm_rlt.engine.disagg.handover_calls import HandoverCalls
from vllm_rlt.engine.disagg.links import KVLinks
from vllm_rlt.engine.disagg.prefetch import (
    PromptBlocks,
    PromptPrefetcher,
)
from vllm_rlt.engine.pass_pipeline import PassPipeline
from vllm_rlt.engine.request_checks import RequestChecker
from vllm_rlt.engine.request_group import RequestGroup, RequestGroups
from vllm_rlt.engine.request_intake import RequestIntake
from vllm_rlt.engine.trainer_hooks import TrainerHooks
from vllm_rlt.engine.weight_sync import WeightSync
from vllm_rlt.parallel.tensor_parallel import mirrored
from vllm_rlt.sampling_params import SamplingParams
from vllm_rlt.tokenizer import Tokenizer
from vllm_rlt.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class EngineCore(HandoverCalls):
    """Owns the scheduler and the runner for one model. It speaks in token ids: each step
    returns what every request that progressed produced (`RequestDelta`); text, stop strings
    and the caller's output form are the frontend's (engine/output_processor.py)."""

    def __init__(
        self,
        model,
        tokenizer: Tokenizer | None,
        max_model_len: int,
        eos_token_ids: frozenset[int],
        scheduler: Scheduler,
        runner: ModelRunner,
        checker: RequestChecker,
        memory_plan: MemoryPlan,
        cache_config: CacheConfig,
        execution_config: ExecutionConfig,
        speculative_config: SpeculativeConfig | None,
        attention_backend: str,
        scheduler_note: str,
    ) -> None:
        """From parts `build_engine_core` (engine/builder.py) made for one model."""
        self.model = model
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.kv = scheduler.kv
        self.runner = runner
        self.checker = checker
        self.memory_plan = memory_plan
        self.cache_config = cache_config
        self.attention_backend = attention_backend
        self.scheduler_note = scheduler_note
        self.num_loops = model.config.num_loops
        self.max_model_len = max_model_len  # prompt + output, at most the model's context
        # Tensor parallelism: rank 0 sends each @mirrored call to the other ranks first
        # (see parallel/tensor_parallel.py).
        self.mirror: Callable[[str, tuple, dict], None] | None = None
        self.eos_token_ids = eos_token_ids
        self.groups = RequestGroups()
        self.handovers: list[KVHandover] = []  # prefill side: offered, not yet taken
        self.ledger = HandoverLedger(self.kv, runner.kv_pool, runner.kv_position_bytes)
        group = getattr(model, "tensor_parallel", None)
        self.links = KVLinks(lambda: runner.kv_pool, 0 if group is None else group.rank)
        self.prefetcher = PromptPrefetcher(scheduler, self.ledger)
        self.prefetches: list[PromptBlocks] = []  # prefill side: lent early, not yet sent
        self.held_back = False  # the last step ran nothing: lent blocks fill the pool
        # no_refill cohorts depend on the previous pass's exits, so they run synchronously.
        self.async_scheduling = (
            execution_config.async_scheduling and scheduler.config.mode == "refill"
        )
        self.passes = PassPipeline(runner, scheduler, self.async_scheduling)
        threshold = model.config.early_exit_threshold
        self.intake = RequestIntake(
            checker, eos_token_ids, threshold, speculative_config, execution_config.seed
        )
        self.hooks = TrainerHooks(
            runner, execution_config.cuda_graphs, scheduler.config.max_num_batched_tokens
        )
        self.weight_sync = WeightSync(self)  # a trainer's group, and the weights' version tag

    # ----------------------------------------------------------------- requests
    @mirrored
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        handover: bool = False,
    ) -> None:
        """Validate and queue a request; any error leaves the engine untouched. With
        `handover`, the request stops here once its completions have their first tokens
        and is offered to a decode core (`take_handovers`, engine/disagg/handover.py)."""
        group = self._new_group(str(request_id), prompt_token_ids, params)
        group.handover = handover
        self._queue(group, group.children)
        if handover:
            self.prefetcher.watch(group)

    def _new_group(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> RequestGroup:
        """The checked group of a new request (nothing queued yet)."""
        self.hooks.check_serving()
        require(isinstance(params, SamplingParams), "sampling_params must be a SamplingParams")
        self.groups.require_free(request_id, params.n)
        return self.intake.group(request_id, prompt_token_ids, params)

    def _queue(self, group: RequestGroup, children: list[Request]) -> None:
        self.groups.add(group)
        for child in children:
            self.scheduler.add_request(child)

    def check_request(
        self, request_id: str, prompt: list[int], params: SamplingParams
    ) -> tuple[int, int, tuple[int, ...] | None]:
        """See `RequestIntake.check`."""
        return self.intake.check(request_id, prompt, params)

    @mirrored
    def abort_request(self, request_id: str, index: int | None = None) -> RequestDelta | None:
        """Stop a request (or only its completion `index`) at any time; blocks and slots
        are freed at once. Answers what changed since the last delta (None: unknown id)."""
        group = self.groups.get(str(request_id))
        if group is None:
            return None
        group.end(self.scheduler, "abort", index)
        self.passes.drain_if_idle()
        return self._delta(group)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.groups) or self.passes.in_flight is not None

    # ----------------------------------------------------------------- one step
    @mirrored
    def step(self) -> list[RequestDelta]:
        """Run one pass; return what each request that progressed produced in it."""
        settled = self.prefetcher.settled() if self.prefetcher.watched else None
        progressed = self._step()
        deltas = [self._delta(group) for group in progressed]
        for group in progressed:
            if group.handover and group.ready_to_hand_over:  # an ended group is never ready
                try:
                    self._hand_over(group)
                except Exception as error:  # noqa: BLE001 - fails this request only
                    deltas.append(self._delta(self._fail(group.children[0], error)))
        if settled is not None:
            planned = self.prefetcher.plan(settled)
            if self.links.rank == 0:
                self.prefetches += planned
        return deltas

    def _step(self) -> list[RequestGroup]:
        """Run one pass; return every group that progressed. With asynchronous scheduling
        the pass launched here is collected by the next step (engine/pass_pipeline.py). A
        failure while handling one request's state (its admission, its tokens) fails that
        request alone; its output carries the error."""
        scheduled, failed = None, []
        if self.scheduler.has_unfinished:
            scheduled = self.scheduler.schedule()
            failed = self._admit(scheduled.new_slots)
        transfers = bool(self.ledger.lent or self.ledger.prefetching)
        done, pass_failed = self.passes.advance(scheduled, transfers)
        # Only blocks lent to decode cores (wait for their release) or early reads an
        # import waits for hold back a pass.
        self.held_back = bool(scheduled and scheduled.is_empty) and self.passes.in_flight is None
        progressed: dict[str, RequestGroup] = {}
        for request, error in failed + pass_failed:
            # Its rows in passes already queued only write to blocks nobody reads before
            # they are written again, and their results are dropped: the request no longer
            # owns its slot when they arrive.
            group = self._fail(request, error)
            progressed[group.request_id] = group
        if done is not None:
            touched = self.scheduler.update(*done)
            now = time.monotonic()
            for request in touched:
                if request.is_finished:
                    continue  # a sibling's failure ended its group within this loop
                if request.first_token_time is None:
                    request.first_token_time = now
                group = self.groups.of(request)
                if request.stop_reason is not None:
                    group.end(self.scheduler, request.stop_reason, group.children.index(request))
                progressed[group.request_id] = group
        self.passes.drain_if_idle()
        return list(progressed.values())

    def _admit(self, new_slots) -> list[tuple[Request, BaseException]]:
        """Write each newly admitted request's slot; the requests whose admission failed."""
        failed = self.runner.admit(new_slots)
        imports = [new for new in new_slots if new.imported_kv is not None]
        if imports:  # a copy that failed on one tensor-parallel rank fails on all
            here = {new.slot for new, _ in failed}
            elsewhere = set().union(*map(set, self._gathered(sorted(here)))) - here
            failed += [
                (new, RuntimeError("the K/V copy failed on another tensor-parallel rank"))
                for new in new_slots
                if new.slot in elsewhere
            ]
        if imports:  # their source may go once the copies queued here are done
            done = self.runner.copies_done()
            failed_slots = {new.slot for new, _ in failed}
            for new in imports:
                request = self.scheduler.running[new.slot]
                request.kv_copy = done
                if new.slot not in failed_slots:
                    self.scheduler.register_imported(request)
        failed_requests = [(self.scheduler.running[new.slot], e) for new, e in failed]
        for request, _ in failed_requests:  # what it registered in the prefix cache was
            self.kv.uncache_private(request.request_id)  # perhaps never written
        return failed_requests

    def _fail(self, request: Request, error: BaseException) -> RequestGroup:
        """End a request's whole group (its completions share one prompt) with the error."""
        group = self.groups.of(request)
        logger.error(
            "request %s failed; the engine keeps running",
            group.request_id,
            exc_info=(type(error), error, error.__traceback__),
        )
        group.end(self.scheduler, "abort")
        group.error = f"{type(error).__name__}: {error}"
        return group

    def _delta(self, group: RequestGroup) -> RequestDelta:
        delta = group.delta()
        self.groups.forget_if_finished(group)
        return delta

    @mirrored
    def reset_prefix_cache(self) -> bool:
        """Forget the cached prompt blocks; False while requests hold blocks."""
        return self.kv.reset_prefix_cache()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (checkpoint name, tensor) pairs into the model in place, so the KV pool, CUDA
        graphs and kernels stay valid; every pair is checked first (ParamError naming a
        wrong name or shape, nothing copied). The prefix cache is reset: its K/V came from
        the old weights. A tied model ignores lm_head.weight, as vLLM does."""
        require(self.mirror is None, "load_weights with tensor_parallel_size > 1 is not supported")
        self._require_idle("load_weights", "weights")
        self.hooks.load_weights(weights)
        self.kv.reset_prefix_cache()

    @mirrored
    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (engine/trainer_hooks.py): level 1 frees the KV pool and moves the
        weights to host memory, level 2 frees both. Only an idle engine sleeps."""
        self._require_idle("sleep", "level")
        self.hooks.sleep(level, tensor_parallel=self.mirror is not None)
        self.kv.reset_prefix_cache()  # the cached blocks' K/V went with the pool

    @mirrored
    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take the memory back, all of it or the parts `tags` names ("weights", "kv_cache"):
        the weights as they were (after level 1), the KV pool empty, and once both are back
        the CUDA graphs captured again. A no-op when awake."""
        self.hooks.wake_up(tags)

    @property
    def is_sleeping(self) -> bool:
        return self.hooks.sleeping is not None

    def _require_idle(self, hook: str, field: str) -> None:
        require(
            not self.has_unfinished,
            f"{hook} needs an idle engine: let running requests finish or abort them",
            field,
        )
        require(
            not (self.ledger.lent or self.ledger.importing or self.ledger.prefetching),
            f"{hook} needs an idle engine: K/V handed to or from another engine is in transit",
            field,
        )

    def stats(self) -> EngineStats:
        passes = self.passes
        return EngineStats.of(self.scheduler, self.runner, passes.num_passes, passes.num_rows_total)

    def all_blocks_free(self) -> bool:
        return self.kv.all_free() and not self.scheduler.running and self.passes.in_flight is None
