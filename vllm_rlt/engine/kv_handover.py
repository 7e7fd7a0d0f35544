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

from dataclasses import dataclass, field
from typing import Any

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
