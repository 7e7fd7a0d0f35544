"""Beam search as vLLM's `LLM.beam_search` runs it: each step asks every live beam of every
prompt for one token and its 2 x beam_width most likely alternatives (one batch of requests
through `generate`, prompt blocks shared through the prefix cache where it is on), and each
prompt keeps its best beam_width continuations. A beam that reaches an EOS token, or the
longest sequence the engine can still extend, is finished instead of failing the batch."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from tqdm import tqdm

from vllm_rlt.beam_search import (
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
    beam_score,
)
from vllm_rlt.engine.input_processor import InputProcessor
from vllm_rlt.outputs import RequestOutput
from vllm_rlt.sampling_params import SamplingParams

# One token for every prompt of a batch, in order.
Step = Callable[[list[list[int]], SamplingParams], list[RequestOutput]]


@dataclass(frozen=True)
class BeamLimits:
    """What the search needs of the engine: the ids that end a beam, the longest sequence a
    step may still extend, and the decoder of the returned texts (None: no tokenizer)."""

    eos_token_ids: frozenset[int]
    longest_prompt: int
    decode: Callable[[list[int]], str] | None


def beam_limits(processor: InputProcessor) -> BeamLimits:
    """An engine's limits: its EOS ids, its longest extendable sequence, and texts decoded
    with special tokens kept (vLLM decodes a beam's whole sequence so)."""
    tokenizer = processor.tokenizer
    return BeamLimits(
        eos_token_ids=processor.eos_token_ids,
        longest_prompt=processor.checker.limits.longest_prompt(),
        decode=None if tokenizer is None else partial(tokenizer.decode, skip_special_tokens=False),
    )


def beam_search(
    prompts: Sequence[list[int]],
    params: BeamSearchParams,
    step: Step,
    limits: BeamLimits,
    use_tqdm: bool = False,
    concurrency_limit: int | None = None,
) -> list[BeamSearchOutput]:
    """The best beams of each prompt, best first, in input order. `concurrency_limit`
    prompts are searched at a time (all of them where None)."""
    group = concurrency_limit or len(prompts)
    outputs: list[BeamSearchOutput] = []
    for start in range(0, len(prompts), group):
        search = BeamSearch(prompts[start : start + group], params, limits)
        bar = tqdm(
            total=params.max_tokens, desc="Beam search", unit="token", file=sys.stderr,
            disable=not use_tqdm,
        )  # fmt: skip
        with bar:
            while batch := search.batch():
                search.advance(step(batch, search.step_params))
                bar.update(1)
        outputs.extend(search.outputs())
    return outputs


class BeamSearch:
    """The search's state between steps, for a synchronous driver (`beam_search`) and an
    asynchronous one alike: `batch()` gives the sequences the next step runs (none when
    the search is over), `advance` takes their outputs, `outputs()` the result."""

    def __init__(
        self, prompts: Sequence[list[int]], params: BeamSearchParams, limits: BeamLimits
    ) -> None:
        self.params = params
        self.limits = limits
        self.step_params = SamplingParams(
            max_tokens=1,
            temperature=params.temperature,
            logprobs=2 * params.beam_width,
            ignore_eos=True,
        )
        self._ends = frozenset() if params.ignore_eos else limits.eos_token_ids
        self._live = [
            [BeamSearchSequence(tokens=list(ids), prompt_len=len(ids))] for ids in prompts
        ]
        self._done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self._running: list[tuple[int, BeamSearchSequence]] = []
        self._steps = 0

    def batch(self) -> list[list[int]]:
        """The sequences of the next step, by prompt; empty once max_tokens steps ran or no
        beam is left to extend."""
        self._running = []
        if self._steps < self.params.max_tokens:
            self._running = _extendable(self._live, self._done, self.limits.longest_prompt)
            self._live = [[] for _ in self._live]  # each beam now runs or is done
        return [beam.tokens for _, beam in self._running]

    def advance(self, results: Sequence[RequestOutput]) -> None:
        """Take the step's outputs, one per sequence of the last `batch()`, in its order. A
        sequence whose step gave no logprobs (it was aborted) has no children, as in
        vLLM."""
        grown: list[list[BeamSearchSequence]] = [[] for _ in self._live]
        for (index, beam), result in zip(self._running, results, strict=True):
            for child in _children(beam, result):
                if child.tokens[-1] in self._ends:
                    child.finish_reason = "stop"
                    self._done[index].append(child)
                else:
                    grown[index].append(child)
        self._live = [self._best(beams) for beams in grown]
        self._running = []
        self._steps += 1

    def outputs(self, unfinished: str = "length") -> list[BeamSearchOutput]:
        """Each prompt's best beams, best first, with their texts; the beams still live end
        with the finish reason `unfinished` (a step taken by `batch()` and never advanced
        counts as not taken)."""
        live = [list(beams) for beams in self._live]
        for index, beam in self._running:
            live[index].append(beam)
        outputs = []
        for index, beams in enumerate(live):
            for beam in beams:
                beam.finish_reason = unfinished
            best = self._best(self._done[index] + beams)
            for beam in best:
                beam.text = None if self.limits.decode is None else self.limits.decode(beam.tokens)
            outputs.append(BeamSearchOutput(sequences=best))
        return outputs

    def _best(self, beams: list[BeamSearchSequence]) -> list[BeamSearchSequence]:
        """The beam_width best by score; ties keep the order they were made in (the
        parent's rank, then the step's)."""
        eos, penalty = self.limits.eos_token_ids, self.params.length_penalty
        ranked = sorted(beams, key=lambda beam: beam_score(beam, eos, penalty), reverse=True)
        return ranked[: self.params.beam_width]


def _extendable(
    live: list[list[BeamSearchSequence]], done: list[list[BeamSearchSequence]], longest: int
) -> list[tuple[int, BeamSearchSequence]]:
    """The beams a step runs, by prompt index. A beam past `longest` is finished with
    "length"; a prompt that is too long itself still runs, so that the engine's check names
    it."""
    running = []
    for index, beams in enumerate(live):
        for beam in beams:
            if len(beam.tokens) > longest and len(beam.tokens) > beam.prompt_len:
                beam.finish_reason = "length"
                done[index].append(beam)
            else:
                running.append((index, beam))
    return running


def _children(beam: BeamSearchSequence, result: RequestOutput) -> list[BeamSearchSequence]:
    """The beam extended by each token its step ranked (and the drawn one)."""
    made = result.outputs[0]
    if not made.logprobs:
        return []
    ranked = made.logprobs[0]
    return [
        BeamSearchSequence(
            tokens=[*beam.tokens, token],
            logprobs=[*beam.logprobs, ranked],
            exit_depths=[*beam.exit_depths, *made.exit_depths[:1]],
            cum_logprob=beam.cum_logprob + logprob.logprob,
            prompt_len=beam.prompt_len,
        )
        for token, logprob in ranked.items()
    ]
