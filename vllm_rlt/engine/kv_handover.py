"""Prefill/decode disaggregation inside one engine core: what a prefill core hands a decode
core once a request's prompt has run and its first tokens are sampled.

A prefill core runs a handed-over request (`EngineCore.add_request(..., handover=True)`) as
usual until every completion has its first token (or has ended). It then copies each live
completion's K/V out of its pool (`ModelRunner.export_kv`: every plane under last_exited,
only the final one under shared_decode, whose other planes are gone by then), frees the
request there and offers a `KVHandover`. The copy covers the prompt, and the decode inputs
of a completion that decoded on while its siblings were still prefilling. A decode core
takes it with `EngineCore.import_request`: each live completion enters a slot already
decoding, its K/V written into fresh blocks before the pass that first reads them, and
continues as it would have on the prefill core (sampling noise depends only on the seed and
the token's number, so seeded and greedy outputs equal a colocated run).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_rlt.config import require
from vllm_rlt.core.request import Request, RequestStatus
from vllm_rlt.engine.request_group import RequestGroup
from vllm_rlt.sampling_params import SamplingParams


@dataclass
class HandedCompletion:
    """One completion at the handover: its seed, what it produced so far (its first token,
    with exit depth and logprobs, or more while its siblings were still prefilling) and, if
    it still runs, the K/V of every position it has computed (the prompt and each output
    but the last) [layers, 2, planes, positions, kv_heads, head_dim]; an ended one has its
    finish reason instead."""

    index: int
    seed: int
    output_token_ids: list[int]
    exit_depths: list[int]
    logprobs: list[float]
    top_logprobs: list[tuple[tuple[int, float], ...]]
    finish_reason: str | None = None
    kv: Any = None

    @property
    def nbytes(self) -> int:
        return 0 if self.kv is None else self.kv.numel() * self.kv.element_size()


@dataclass
class KVHandover:
    """A request whose prompt a prefill core ran, ready to decode elsewhere. The frontend
    has had its first tokens and its prompt logprobs from the prefill core."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    completions: list[HandedCompletion] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """K/V bytes moved: one copy of the prompt per live completion."""
        return sum(completion.nbytes for completion in self.completions)


def hand_over(group: RequestGroup, copy_kv: Callable[[Request], Any]) -> KVHandover:
    """The handover of `group`, whose completions all have their first tokens or have
    ended: `copy_kv(completion)` copies a live one's K/V. Completions of one request reach
    their first tokens in different passes and decode on meanwhile, so a copy covers every
    position a completion has computed."""
    completions = [
        HandedCompletion(
            index=index,
            seed=child.seed,
            output_token_ids=list(child.output_token_ids),
            exit_depths=list(child.exit_depths),
            logprobs=list(child.logprobs),
            top_logprobs=list(child.top_logprobs),
            finish_reason=group.finish_reasons.get(index),
            kv=None if child.is_finished else copy_kv(child),
        )
        for index, child in enumerate(group.children)
    ]
    params = group.children[0].params
    return KVHandover(group.request_id, group.prompt_token_ids, params, completions)


def continue_completions(group: RequestGroup, handover: KVHandover) -> list[Request]:
    """Give a newly checked `group` the handed-over completions' state; returns the live
    ones, to queue (each brings its K/V for admission). Nothing is queued on an error."""
    require(
        len(handover.completions) == len(group.children),
        f"a handover carries every completion: {len(group.children)}, got "
        f"{len(handover.completions)}",
        "completions",
    )
    live = []
    pairs = zip(group.children, handover.completions, strict=True)
    for index, (child, handed) in enumerate(pairs):
        child.seed = handed.seed
        child.prompt_logprobs = None  # reported by the prefill core
        child.output_token_ids = list(handed.output_token_ids)
        child.exit_depths = list(handed.exit_depths)
        child.logprobs = list(handed.logprobs)
        child.top_logprobs = list(handed.top_logprobs)
        if handed.finish_reason is not None:
            child.status = RequestStatus.FINISHED
            child.finish_reason = handed.finish_reason
            group.finish_reasons[index] = handed.finish_reason
            group.finish_sent.add(index)
            continue
        positions = child.prefill_len
        brought = None if handed.kv is None else handed.kv.shape[3]
        require(
            bool(child.output_token_ids) and brought == positions,
            f"a live completion brings its first token and the K/V of its {positions} "
            f"computed positions, got {brought}",
            "completions",
        )
        child.kv_import = handed.kv
        child.first_token_time = time.monotonic()
        live.append(child)
    group.sent = [len(child.output_token_ids) for child in group.children]
    group.prompt_logprobs_sent = True
    return live
