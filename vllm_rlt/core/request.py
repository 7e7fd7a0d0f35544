"""A request's host-side state: ids, parameters, phase, and the tokens it has produced."""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field, fields
from typing import Protocol

from vllm_rlt.core.contract import ImportedKV, Penalties, PrefillChunk, SamplingRecord
from vllm_rlt.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


class CopyDone(Protocol):
    """Says whether copies queued on the device are done (a CUDA event)."""

    def query(self) -> bool: ...


@dataclass
class Request:
    """Owned by the scheduler and the engine; the runner only ever sees contract types."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    min_loops: int
    max_loops: int
    exit_threshold: float
    seed: int
    eos_token_ids: frozenset[int] = frozenset()  # empty when ignore_eos
    stop_token_ids: frozenset[int] = frozenset()  # a set: a long list must not cost per token
    status: RequestStatus = RequestStatus.WAITING
    slot: int | None = None
    num_prefilled: int = 0  # prompt positions that finished every loop
    chunk_start: int = 0  # the prefill chunk in flight: positions and next loop
    chunk_len: int = 0
    chunk_loop: int = 0
    chunk_depth: int = 0  # loops the chunk in flight runs
    # What admission must compute before decoding, as (end position, depth, replayed):
    # the prompt at full depth, then (after a preemption) the generated tokens that were
    # decode inputs, in runs of equal exit depth. Set when the request gets a slot.
    prefill_plan: list[tuple[int, int, bool]] = field(default_factory=list)
    preempted_in: int = -1  # the scheduling round that last preempted it
    sequence: int = 0  # arrival order, set by the scheduler
    admission: int = 0  # the scheduler's number for its latest placement in a slot
    block_hashes: list[bytes] | None = None  # of the prompt's full blocks (prefix caching)
    num_registered: int = 0  # prompt blocks of its table registered in the prefix cache
    token_in_flight: bool = False  # a decode token has started its loops but not exited
    speculates: bool = False  # decodes in self-speculation lanes (set by the engine)
    # Drafting is off and only its own slot's lane works: it decodes as a plain row.
    lanes_collapsed: bool = False
    bypass_count: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    exit_depths: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)  # of each output token among all tokens
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    # Prompt logprobs, for the one completion of a prompt that reports them: the top count
    # asked for, and per prompt position (from 1) the token's logprob, its rank and the top
    # alternatives.
    prompt_logprobs: int | None = None
    prompt_logprob_values: dict[int, tuple[float, int, tuple[tuple[int, float], ...]]] = field(
        default_factory=dict
    )
    # Prompt tokens its first admission found in the prefix cache (vLLM's num_cached_tokens).
    num_cached_tokens: int | None = None
    finish_reason: str | None = None
    # Why its tokens ended (core/stopping.py), set when the token that ends it arrives.
    stop_reason: str | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    # Its prompt K/V from a prefill core (engine/disagg/handover.py), until admission copies
    # it; then, on CUDA, the event that says the copy is done.
    kv_import: ImportedKV | None = None
    kv_copy: CopyDone | None = None

    @functools.cached_property
    def sampling(self) -> SamplingRecord:
        """Its settings as the device needs them (built on first use, kept)."""
        params = self.params
        penalties = None
        if params.adjusts_logits:
            penalties = Penalties(
                repetition=params.repetition_penalty,
                frequency=params.frequency_penalty,
                presence=params.presence_penalty,
                logit_bias=tuple(sorted((params.logit_bias or {}).items())),
                prompt_token_ids=(
                    tuple(self.prompt_token_ids) if params.repetition_penalty != 1.0 else ()
                ),
                allowed_token_ids=tuple(sorted(set(params.allowed_token_ids or ()))),
                bad_words=tuple(map(tuple, params.bad_words_token_ids or ())),
            )
        resolved = dict(
            min_loops=self.min_loops,
            max_loops=self.max_loops,
            exit_threshold=self.exit_threshold,
            seed=self.seed,
            num_logprobs=params.logprobs or 0,
            banned_until_min_tokens=tuple(sorted(self.stop_token_ids | self.eos_token_ids)),
            penalties=penalties,
        )
        # every other field is the SamplingParams field of its name
        same = {
            f.name: getattr(params, f.name)
            for f in fields(SamplingRecord)
            if f.name not in resolved
        }
        return SamplingRecord(**same, **resolved)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def prefill_len(self) -> int:
        """Positions computed before decoding: the prompt, plus every generated token but
        the last when the request resumes after a preemption."""
        return self.prompt_len + max(len(self.output_token_ids) - 1, 0)

    def context_token_ids(self, start: int, end: int) -> tuple[int, ...]:
        """The input token of positions [start, end): prompt, then generated tokens."""
        prompt, length = self.prompt_token_ids, self.prompt_len
        head = tuple(prompt[start : min(end, length)])
        if end <= length:
            return head
        return head + tuple(self.output_token_ids[max(start - length, 0) : end - length])

    def plan_prefill(self, num_loops: int) -> None:
        """The prompt at full depth; then each generated decode input (position P + i - 1
        for token i >= 1) at the depth token i exited with, grouped in equal runs."""
        plan = [(self.prompt_len, num_loops, False)]
        for i, depth in enumerate(self.exit_depths[1 : len(self.output_token_ids)], 1):
            end = self.prompt_len + i
            if plan[-1][2] and plan[-1][1] == depth:
                plan[-1] = (end, depth, True)
            else:
                plan.append((end, depth, True))
        self.prefill_plan = plan

    def prefill_segment(self, position: int) -> tuple[int, int, bool]:
        """The plan's segment that holds `position`."""
        return next(segment for segment in self.prefill_plan if position < segment[0])

    def prefill_chunk(self) -> PrefillChunk:
        """The loop of its prefill chunk in flight that the next pass runs."""
        start, length = self.chunk_start, self.chunk_len
        end = start + length
        replayed = self.prefill_segment(start)[2]
        last = (
            end == self.prefill_len
            and self.chunk_loop == self.chunk_depth - 1
            and not self.output_token_ids
        )
        targets: tuple[int, ...] = ()
        if (
            self.prompt_logprobs is not None
            and not replayed
            and self.chunk_loop == self.chunk_depth - 1
            and not self.output_token_ids  # a resumed request has them already
        ):
            targets = tuple(self.prompt_token_ids[start + 1 : min(end + 1, self.prompt_len)])
        return PrefillChunk(
            slot=self.slot,  # type: ignore[arg-type]
            request_id=self.request_id,
            start=start,
            token_ids=self.context_token_ids(start, end),
            loop=self.chunk_loop,
            samples=last,
            depth=self.chunk_depth,
            deep_writes=replayed,
            admission=self.admission,
            prompt_targets=targets,
            prompt_top=self.prompt_logprobs or 0,
        )

    @property
    def reserved_positions(self) -> int:
        """The last sampled token is never forwarded: prompt + max_tokens - 1 positions."""
        return self.prompt_len + self.params.max_tokens - 1

    @property
    def context_len(self) -> int:
        """Positions holding K/V once the token now in flight has been written."""
        if self.status is RequestStatus.DECODE:
            return self.prompt_len + len(self.output_token_ids)
        return self.chunk_start + self.chunk_len

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
