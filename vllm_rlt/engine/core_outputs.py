"""What an engine core reports, in process or over the wire: each request's progress in a
step (`RequestDelta`, one `CompletionDelta` per completion) and the counters the metrics
read (`EngineStats`, a core process's `CoreStats`)."""

from __future__ import annotations

import itertools
from typing import Any

import msgspec


class CompletionDelta(msgspec.Struct, array_like=True):
    """What one completion produced since the previous message: tokens `start` onwards.
    `stop_token`: with finish reason "stop", the stop id (not EOS) that ended it."""

    index: int
    start: int
    token_ids: list[int]
    exit_depths: list[int]
    logprobs: list[float] | None  # the sampled tokens' logprobs, when asked for
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: str | None
    ranks: list[int] | None = None  # the sampled tokens' ranks, with their logprobs
    stop_token: int | None = None


class RequestDelta(msgspec.Struct, array_like=True):
    """One request's progress in a step. `finished`: the core holds nothing of it any more.
    `error` says why the core failed it alone (`invalid`: a bad request, else internal)."""

    request_id: str
    completions: list[CompletionDelta]
    finished: bool
    error: str | None = None
    error_param: str | None = None
    invalid: bool = False
    # Sent once, in the first delta after the whole prompt was computed: per prompt position
    # from the second, the token's logprob, its rank and the top (id, logprob) alternatives.
    prompt_logprobs: list[tuple[float, int, list[tuple[int, float]]]] | None = None
    num_cached_tokens: int | None = None  # the first completion's, once admitted


class EngineStats(msgspec.Struct, array_like=True):
    """Counters the metrics read; passes, rows and preemptions count since startup."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    num_passes: int
    num_rows: int
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of them, found there
    spec_num_drafts: int = 0  # draft tokens verified (each on its own)
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = []  # accepted drafts made i + 1 ahead
    # Passes that replayed captured CUDA graphs; the other passes ran eagerly (no graphs, or
    # a pass the graphs do not take: prompt logprobs, too many rows or sampling prompts).
    num_decode_graph_passes: int = 0
    num_prompt_graph_passes: int = 0

    @classmethod
    def of(cls, scheduler, runner, num_passes: int, num_rows: int) -> EngineStats:
        """The counters of an engine core with this scheduler and runner."""
        return cls(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            num_free_blocks=scheduler.kv.num_free_blocks,
            num_blocks=scheduler.kv.num_blocks,
            num_passes=num_passes,
            num_rows=num_rows,
            num_preemptions=scheduler.num_preemptions,
            prefix_cache_queries=scheduler.prefix_queries,
            prefix_cache_hits=scheduler.prefix_hits,
            spec_num_drafts=scheduler.num_drafted,
            spec_num_draft_tokens=scheduler.num_drafted,
            spec_num_accepted_tokens=scheduler.num_accepted,
            spec_accepted_per_position=list(scheduler.accepted_at),
            num_decode_graph_passes=runner.num_decode_graph_passes,
            num_prompt_graph_passes=runner.num_prompt_graph_passes,
        )


class CoreStats(EngineStats):
    """A core's answer to the "stats" control call: its engine's counters and what only the
    core's loop knows. With several data-parallel cores the frontend answers their sum
    (`sum_core_stats`), each core's own in `per_core` (a lost core's as None)."""

    num_requests: int = 0
    num_free_slots: int = 0
    num_cached_blocks: int = 0
    has_unfinished: bool = False
    all_blocks_free: bool = True
    passes_per_second: float = 0.0
    rows_per_pass: float = 0.0  # mean over the passes of the last few seconds
    per_core: list[CoreStats | None] = []  # filled by the frontend only


def sum_core_stats(values: list[CoreStats]) -> CoreStats:
    """Counters and gauges add up, flags combine, rows per pass is the mean over every
    core's passes, and accepted drafts add up position by position."""
    total: dict[str, Any] = {}
    for name in CoreStats.__struct_fields__:
        column = [getattr(value, name) for value in values]
        if name == "has_unfinished":
            total[name] = any(column)
        elif name == "all_blocks_free":
            total[name] = all(column)
        elif name == "spec_accepted_per_position":
            total[name] = [sum(counts) for counts in itertools.zip_longest(*column, fillvalue=0)]
        elif name not in ("rows_per_pass", "per_core"):
            total[name] = sum(column)
    rows = sum(value.rows_per_pass * value.passes_per_second for value in values)
    total["rows_per_pass"] = rows / total["passes_per_second"] if rows else 0.0
    return CoreStats(**total)
