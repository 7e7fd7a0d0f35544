"""EngineCore: validate requests, then schedule -> execute -> update, one pass per step."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import torch

from vllm_rlt.config import CacheConfig, ExecutionConfig, SpeculativeConfig, require
from vllm_rlt.core.memory import MemoryPlan
from vllm_rlt.core.request import Request
from vllm_rlt.core.scheduler import Scheduler
from vllm_rlt.engine.core_outputs import EngineStats, RequestDelta
from vllm_rlt.engine.disagg.engine_side import Disaggregation
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


class EngineCore:
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
        disaggregated: bool = False,
    ) -> None:
        """From parts `build_engine_core` (engine/builder.py) made for one model; only a
        `disaggregated` one hands requests to other cores (engine/disagg/engine_side.py)."""
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
        # Rank 0 under tensor parallelism: sends @mirrored calls (parallel/tensor_parallel.py).
        self.mirror: Callable[[str, tuple, dict], None] | None = None
        self.eos_token_ids = eos_token_ids
        self.groups = RequestGroups(scheduler)
        self.held_back = False  # the last step ran nothing: lent blocks fill the pool
        # no_refill cohorts depend on the previous pass's exits, so they run synchronously.
        self.async_scheduling = (
            execution_config.async_scheduling and scheduler.config.mode == "refill"
        )
        self.passes = PassPipeline(runner, scheduler, self.async_scheduling)
        self.intake = RequestIntake(
            checker,
            eos_token_ids,
            model.config.exit_threshold,
            speculative_config,
            execution_config.seed,
        )
        self.hooks = TrainerHooks(
            runner, execution_config.cuda_graphs, scheduler.config.max_num_batched_tokens
        )
        self.weight_sync = WeightSync(self)  # a trainer's group, and the weights' version tag
        self.disagg = Disaggregation(self) if disaggregated else None

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
        `handover` (a disaggregated engine's), the request stops here once its completions
        have their first tokens and is offered to a decode core (engine/disagg/handover.py)."""
        require(
            not handover or self.disagg is not None,
            "handover needs an engine built for disaggregation",
            "handover",
        )
        group = self.new_group(str(request_id), prompt_token_ids, params)
        self.groups.queue(group, group.children)
        if handover and self.disagg is not None:
            self.disagg.watch(group)

    def new_group(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> RequestGroup:
        """The checked group of a new request (nothing queued yet)."""
        self.hooks.check_serving()
        require(isinstance(params, SamplingParams), "sampling_params must be a SamplingParams")
        self.groups.require_free(request_id, params.n)
        return self.intake.group(request_id, prompt_token_ids, params)

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
        return self.groups.delta(group)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.groups) or self.passes.in_flight is not None

    # ----------------------------------------------------------------- one step
    @mirrored
    def step(self) -> list[RequestDelta]:
        """Run one pass; return what each request that progressed produced in it."""
        if self.disagg is not None:
            self.disagg.before_schedule()
        progressed = self._step()
        deltas = [self.groups.delta(group) for group in progressed]
        if self.disagg is not None:
            deltas += self.disagg.after_step(progressed)
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
        in_transit = self.disagg is not None and self.disagg.in_transit  # may hold passes back
        done, pass_failed = self.passes.advance(scheduled, in_transit)
        self.held_back = bool(scheduled and scheduled.is_empty) and self.passes.in_flight is None
        # A failed request's rows in passes already queued only write to blocks nobody
        # reads before they are written again, and their results are dropped: the request
        # no longer owns its slot when they arrive.
        progressed = [self.groups.fail(request, error) for request, error in failed + pass_failed]
        if done is not None:
            progressed += self.groups.record(self.scheduler.update(*done), time.monotonic())
        self.passes.drain_if_idle()
        return list({group.request_id: group for group in progressed}.values())

    def _admit(self, new_slots) -> list[tuple[Request, BaseException]]:
        """Write each newly admitted request's slot; the requests whose admission failed."""
        failed = self.runner.admit(new_slots)
        if self.disagg is not None:  # imports
            failed = self.disagg.after_admit(new_slots, failed)
        failed_requests = [(self.scheduler.running[new.slot], e) for new, e in failed]
        for request, _ in failed_requests:  # what it registered in the prefix cache was
            self.kv.uncache_private(request.request_id)  # perhaps never written
        return failed_requests

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
        if self.disagg is not None:
            self.disagg.require_idle(hook, field)

    def stats(self) -> EngineStats:
        passes = self.passes
        return EngineStats.of(self.scheduler, self.runner, passes.num_passes, passes.num_rows_total)

    def all_blocks_free(self) -> bool:
        return self.kv.all_free() and not self.scheduler.running and self.passes.in_flight is None
