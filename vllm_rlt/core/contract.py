"""The only types that cross between the scheduler and the model runner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class ImportedKV(Protocol):
    """K/V of a request that another engine core computed (prefill/decode disaggregation,
    engine/disagg/handover.py), copied into this core's blocks when it is admitted."""

    def awaits_reads(self) -> bool:
        """Whether blocks read for it early are still on their way: admission waits."""
        ...


@dataclass(frozen=True)
class Penalties:
    """A request's logit adjustments (SamplingParams), the prompt tokens the repetition
    penalty looks at, the only tokens it may sample (if restricted), and its bad words."""

    repetition: float
    frequency: float
    presence: float
    logit_bias: tuple[tuple[int, float], ...]
    prompt_token_ids: tuple[int, ...]
    allowed_token_ids: tuple[int, ...] = ()  # empty: every token may be sampled
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences never to complete


@dataclass(frozen=True)
class SamplingRecord:
    """Everything a request's device row needs of its settings, built once per request
    (`Request.sampling`) and carried by each of its admissions. A field named as a
    SamplingParams field holds that field's value (`Request.sampling` copies it by name), and
    the slot state writes it into the device column of its name."""

    min_loops: int
    max_loops: int
    exit_threshold: float
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    top_n_sigma: float
    seed: int
    min_tokens: int
    num_logprobs: int
    banned_until_min_tokens: tuple[int, ...]  # EOS / stop ids masked before min_tokens
    penalties: Penalties | None = None  # None: the logits go to sampling as they are


@dataclass(frozen=True)
class NewSlot:
    """A request admitted into a runner slot: who it is, its settings (`sampling`) and
    where it starts. Its blocks arrive through `SchedulerOutput.block_updates`, as they are needed.

    A request resumed after preemption has produced `num_generated` tokens already: its
    first decode input is `first_token` at position `prompt_len` (its prompt and replayed
    outputs fill the positions before); a fresh request has `first_token` -1 and samples
    its first token at the end of its prompt."""

    slot: int
    request_id: str  # the engine request's id (`Request.request_id`)
    prompt_len: int
    sampling: SamplingRecord
    first_token: int = -1
    num_generated: int = 0
    # A resumed request's outputs, when its penalties count them (else empty).
    output_token_ids: tuple[int, ...] = ()
    # Self-speculation (worker/spec_lanes.py): the request decodes in lanes, none of
    # which computes a position past `last_position` (the one that samples its last token).
    speculates: bool = False
    last_position: int = 0
    # Prefill/decode disaggregation (engine/disagg/handover.py): the prompt K/V another core
    # computed, written into `imported_blocks` (the positions' blocks, in order) at
    # admission, from position `imported_from` on (the blocks before it came from this
    # core's prefix cache); the request then decodes from `first_token` at once.
    imported_kv: ImportedKV | None = None
    imported_blocks: tuple[int, ...] = ()
    imported_from: int = 0


@dataclass(frozen=True)
class PrefillChunk:
    """Positions [start, start + len(token_ids)) of one request, all at `loop` this pass.

    A prompt chunk runs every loop (`depth` = the model's loops) and writes each loop's K/V
    to that loop's plane. A replay chunk re-computes generated tokens of a preempted request
    that all exited at `depth`: like the decode rows they were, it writes each loop's K/V to
    that plane and every deeper one (`deep_writes`), so the cache ends as decoding left it."""

    slot: int
    request_id: str
    start: int
    token_ids: tuple[int, ...]
    loop: int
    samples: bool  # last chunk of the prompt at its last loop: sample the first output token
    depth: int = 0  # loops this chunk runs; 0: all of the model's
    deep_writes: bool = False
    admission: int = 0  # which admission of the request scheduled it (see SchedulerOutput)
    # Prompt logprobs, at a prompt chunk's last loop: the prompt tokens its first rows
    # predict (row i predicts position start + i + 1), each with the top `prompt_top`.
    prompt_targets: tuple[int, ...] = ()
    prompt_top: int = 0


@dataclass(frozen=True)
class SchedulerOutput:
    """The rows of one pass: one decode row per listed slot, then the prefill chunks."""

    new_slots: tuple[NewSlot, ...]
    decode_slots: tuple[int, ...]
    decode_request_ids: tuple[str, ...]  # who owned each decode slot when it was scheduled
    prefill_chunks: tuple[PrefillChunk, ...]
    max_context: int  # upper bound of (position + 1) over all rows, for attention padding
    # (table row, index in it, block id): blocks taken for this pass's rows, to be written
    # into the device tables before it runs. A slot has one table row, or one per loop under
    # SHARED_DECODE (row slot * loops + loop; the last is the final plane's).
    block_updates: tuple[tuple[int, int, int], ...] = ()
    # The admission of each decode slot's owner: a result that comes back after its request
    # left the slot (finished, preempted) and came back, or after its id was reused, is not
    # that request's any more.
    decode_admissions: tuple[int, ...] = ()
    # Self-speculation: whether some decode rows are lanes of a speculating request, and
    # whether lanes may draft in this pass; `round` numbers the schedule.
    speculating: bool = False
    drafting: bool = False
    round: int = 0

    @property
    def num_rows(self) -> int:
        return len(self.decode_slots) + sum(len(c.token_ids) for c in self.prefill_chunks)

    @property
    def is_empty(self) -> bool:
        return not self.decode_slots and not self.prefill_chunks

    def owners(self) -> dict[int, tuple[str, int]]:
        """slot -> (request id, admission) of the request its result belongs to (a slot may
        be reused before it arrives)."""
        owners = dict(
            zip(
                self.decode_slots,
                zip(self.decode_request_ids, self.decode_admissions, strict=True),
                strict=True,
            )
        )
        owners.update((c.slot, (c.request_id, c.admission)) for c in self.prefill_chunks)
        return owners


@dataclass(frozen=True)
class SampledToken:
    """A token that finished its loops this pass and was sampled."""

    slot: int
    token_id: int
    exit_depth: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...]
    # Self-speculation: a draft stood at this token's position; whether it was accepted;
    # how many drafts ahead of the verified token it was made (1 = the next one).
    drafted: bool = False
    accepted: bool = False
    ahead: int = 0
    rank: int = 1  # among all tokens, 1-based (vLLM's Logprob.rank)


@dataclass(frozen=True)
class PromptLogprobs:
    """Logprobs of the prompt tokens at positions start, start + 1, ... of a slot's request,
    each with its rank among all tokens and its top alternatives (id, logprob)."""

    slot: int
    start: int
    logprobs: tuple[float, ...]
    ranks: tuple[int, ...]
    top: tuple[tuple[tuple[int, float], ...], ...]


@dataclass(frozen=True)
class ModelRunnerOutput:
    """What one pass produced, read back from the device once."""

    sampled: tuple[SampledToken, ...]
    decode_slots_continuing: tuple[int, ...]  # decode rows whose token needs more loops
    prompt_logprobs: tuple[PromptLogprobs, ...] = ()
