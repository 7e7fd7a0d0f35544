"""The frontend's output processor: the core's token deltas in, the caller's outputs out.

The engine core only sends token ids, exit depths and logprobs, and ends requests on token
ids (EOS, stop ids, length). Here, on the caller's side, each user request's completions
become text (without the EOS or stop id that ended them, as in vLLM V1, unless
`include_stop_str_in_output`), logprobs become `Logprob`s, stop strings end completions
(the caller then aborts them in the core), n completions merge into one output, and the
output takes the form the request asked for (`RequestOutputKind`). `LLM` and `AsyncLLM`
both run it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_rlt.config import ParamError
from vllm_rlt.engine.core_outputs import CompletionDelta, RequestDelta
from vllm_rlt.logprobs import Logprob, PromptLogprobs, SampleLogprobs
from vllm_rlt.outputs import CompletionOutput, RequestMetrics, RequestOutput
from vllm_rlt.sampling_params import RequestOutputKind, SamplingParams
from vllm_rlt.tokenizer import IncrementalDetokenizer, Tokenizer


class TextTracker:
    """One completion's text: incremental detokenization, and the search for stop strings
    in the part a new token could have completed (the stop text itself is cut off)."""

    def __init__(
        self,
        tokenizer: Tokenizer | None,
        prompt_token_ids: list[int],
        stops: list[str],
        include_stop: bool = False,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self.detokenizer = (
            IncrementalDetokenizer(
                tokenizer, prompt_token_ids, skip_special_tokens, spaces_between_special_tokens
            )
            if tokenizer is not None
            else None
        )
        self.stops = stops
        self.include_stop = include_stop
        self.text = ""
        self.stopped: str | None = None  # the stop string that ended the text
        self._flushed = False

    def add(self, token: int, check_stops: bool) -> bool:
        """Append one token; True once a stop string has ended the text."""
        previous = len(self.text)
        if self.detokenizer is not None:
            self.text += self.detokenizer.add(token)
        if check_stops and self.stops and self.stopped is None:
            hits = [
                (index, -len(stop), stop)
                for stop in self.stops
                if (index := self.text.find(stop, max(0, previous - len(stop) + 1))) >= 0
            ]
            if hits:
                index, _, stop = min(hits)  # the earliest, then the longest
                self.text = self.text[: index + len(stop) if self.include_stop else index]
                self.stopped = stop
        return self.stopped is not None

    def drop_held_back(self) -> None:
        """The text is final as it stands: bytes held back are never decoded."""
        self._flushed = True

    def final_text(self) -> str:
        """The text once generation ended: held-back bytes are flushed, unless a stop
        string cut the text."""
        if not self._flushed and self.stopped is None and self.detokenizer is not None:
            self.text += self.detokenizer.flush()
            self._flushed = True
        return self.text


@dataclass
class CompletionState:
    """One completion as far as the core has sent it, with its text."""

    tracker: TextTracker
    token_ids: list[int] = field(default_factory=list)
    exit_depths: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop id or stop string that ended it
    sent_tokens: int = 0  # what DELTA outputs have already carried
    sent_text: int = 0
    finish_sent: bool = False
    cumulative_logprob: float | None = None  # of the tokens kept, with logprobs asked for


class RequestFailedError(RuntimeError):
    """The engine failed this request alone; other requests and the engine are unaffected."""


class RequestState:
    """One user request in the frontend: its completions' tokens and text, from the core's
    deltas, and the outputs its caller gets."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer | None,
        arrival_time: float,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.kind = params.output_kind
        stops = params.stop or []
        self.tokenizer = tokenizer
        # Text that could still become a stop string waits, unless stop strings stay in the
        # text (a match then only cuts what follows it, in the same token).
        longest = max((len(stop) for stop in stops), default=1)  # type: ignore[arg-type]
        self.hold_back = 0 if params.include_stop_str_in_output else longest - 1
        self.completions = [
            CompletionState(
                TextTracker(
                    tokenizer,
                    prompt_token_ids,
                    stops,  # type: ignore[arg-type]
                    params.include_stop_str_in_output,
                    params.skip_special_tokens,
                    params.spaces_between_special_tokens,
                )
            )
            for _ in range(params.n)
        ]
        self.arrival_time = arrival_time
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.prompt_logprobs: PromptLogprobs | None = None
        self.num_cached_tokens: int | None = None
        self.error: str | None = None
        self.failure: BaseException | None = None  # the error as the caller raises it
        self.engine_done = False  # the core holds nothing of this request any more
        self.decode_depth_sum = 0
        self.decode_depth_count = 0

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)

    def absorb(self, delta: RequestDelta, now: float) -> list[int]:
        """Take in one delta of the core; the completions a stop string has just ended (the
        caller aborts them in the core)."""
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = [None] + [
                self._logprobs(token, chosen, rank, top)
                for token, (chosen, rank, top) in zip(
                    self.prompt_token_ids[1:], delta.prompt_logprobs, strict=True
                )
            ]
        if self.num_cached_tokens is None:  # a decode core's import keeps the prefill core's
            self.num_cached_tokens = delta.num_cached_tokens
        stopped = []
        for part in delta.completions:
            if self._absorb_completion(part):
                stopped.append(part.index)
            if part.token_ids and self.first_token_time is None:
                self.first_token_time = now
        if delta.error is not None:
            self.error = delta.error
            self.failure = (
                ParamError(delta.error, delta.error_param)
                if delta.invalid
                else RequestFailedError(f"request failed in the engine: {delta.error}")
            )
        if delta.finished:
            self.engine_done = True
        if self.finished_time is None and (self.finished or delta.finished):
            self.finished_time = now
        return stopped

    def abandon(self, now: float) -> None:
        """The reader left before the end: what is unfinished ends as aborted (its figures
        still go to the metrics)."""
        for completion in self.completions:
            if completion.finish_reason is None:
                completion.finish_reason = "abort"
        if self.finished_time is None:
            self.finished_time = now

    def fail(self, error: BaseException, now: float) -> None:
        """End the request here with `error` (its tokens could not be turned into output);
        the caller aborts it in the core. Text held back for incomplete characters is
        dropped, not decoded."""
        self.error = f"{type(error).__name__}: {error}"
        self.failure = RequestFailedError(f"request failed in the frontend: {self.error}")
        for completion in self.completions:
            completion.tracker.drop_held_back()
            if completion.finish_reason is None:
                completion.finish_reason = "abort"
        if self.finished_time is None:
            self.finished_time = now

    def _absorb_completion(self, part: CompletionDelta) -> bool:
        """Whether a stop string ended the completion in this part."""
        completion = self.completions[part.index]
        if completion.finish_reason is not None:
            return False  # ended here by a stop string: what the core ran on is dropped
        with_logprobs = part.logprobs is not None and part.top_logprobs is not None
        if with_logprobs and completion.logprobs is None:
            completion.logprobs, completion.cumulative_logprob = [], 0.0
        min_tokens = self.params.min_tokens
        # Tokens before `text_end` become text: vLLM V1 leaves the EOS or stop id that ended
        # a completion out.
        text_end = len(part.token_ids)
        if part.finish_reason == "stop" and not self.params.include_stop_str_in_output:
            text_end -= 1
        for offset, token in enumerate(part.token_ids):
            depth = part.exit_depths[offset]
            completion.token_ids.append(token)
            completion.exit_depths.append(depth)
            if part.start + offset > 0:  # the first token's depth is the prompt's
                self.decode_depth_sum += depth
                self.decode_depth_count += 1
            if with_logprobs:
                chosen = part.logprobs[offset]  # type: ignore[index]
                rank = part.ranks[offset] if part.ranks is not None else None
                top = part.top_logprobs[offset]  # type: ignore[index]
                entry = self._logprobs(token, chosen, rank, top)  # type: ignore[arg-type]
                completion.logprobs.append(entry)  # type: ignore[union-attr]
                completion.cumulative_logprob += chosen  # type: ignore[operator]
            if offset == text_end:
                break
            check_stops = len(completion.token_ids) >= min_tokens
            if completion.tracker.add(token, check_stops):
                completion.finish_reason = "stop"
                completion.stop_reason = completion.tracker.stopped
                return True
        if part.finish_reason is not None:
            completion.finish_reason = part.finish_reason
            completion.stop_reason = part.stop_token
        return False

    def _logprobs(
        self, token: int, chosen: float, rank: int | None, top: list[tuple[int, float]]
    ) -> dict[int, Logprob]:
        """vLLM's entry of one position: the token's own Logprob first, then the top
        alternatives', ranked 1, 2, ... (a token among them keeps its first place in the dict
        with the top list's value and rank)."""
        entry = {token: Logprob(chosen, rank, self._token_text(token))}
        for position, (top_token, value) in enumerate(top, 1):
            entry[top_token] = Logprob(value, position, self._token_text(top_token))
        return entry

    def _token_text(self, token: int) -> str | None:
        """vLLM's decoded_token: the token decoded alone, special tokens included."""
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token], skip_special_tokens=False)

    def output(self) -> RequestOutput | None:
        """What the caller gets now, in the request's output kind; None when that kind has
        nothing to say yet."""
        finished = self.finished
        if self.kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if self.kind != RequestOutputKind.DELTA:
            return self._output(finished, copy=not finished)
        completions = self._deltas()
        if not completions and not finished:
            return None
        return self._output(finished, completions)

    def final_output(self) -> RequestOutput:
        """Everything, whatever the output kind (for metrics once the request ended)."""
        return self._output(self.finished, copy=False)

    def _output(
        self,
        finished: bool,
        completions: list[CompletionOutput] | None = None,
        copy: bool = False,
    ) -> RequestOutput:
        if completions is None:
            completions = [self._cumulative(i, c, copy) for i, c in enumerate(self.completions)]
        first = self.first_token_time
        count = self.decode_depth_count
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=RequestMetrics(
                arrival_time=self.arrival_time,
                first_token_time=first,
                finished_time=self.finished_time if finished else None,
                time_to_first_token=None if first is None else first - self.arrival_time,
                mean_loops_per_token=self.decode_depth_sum / count if count else None,
            ),
            error=self.error,
            prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens or 0,
        )

    @staticmethod
    def _cumulative(index: int, completion: CompletionState, copy: bool) -> CompletionOutput:
        """Everything so far; copied while the request runs, so that an output the caller
        keeps does not change under it."""
        ended = completion.finish_reason is not None
        tracker = completion.tracker
        logprobs = completion.logprobs
        return CompletionOutput(
            index=index,
            text=tracker.final_text() if ended else tracker.text,
            token_ids=list(completion.token_ids) if copy else completion.token_ids,
            exit_depths=list(completion.exit_depths) if copy else completion.exit_depths,
            logprobs=list(logprobs) if copy and logprobs is not None else logprobs,
            finish_reason=completion.finish_reason,
            cumulative_logprob=completion.cumulative_logprob,
            stop_reason=completion.stop_reason,
        )

    def _deltas(self) -> list[CompletionOutput]:
        """What each completion added since the previous output: its new tokens, and its new
        text except the end that could still become a stop string. With prompt logprobs
        asked for, a completion's first output waits for them (the first completion
        computes them, and another may get there first)."""
        waiting_for_prompt = (
            self.params.prompt_logprobs is not None and self.prompt_logprobs is None
        )
        deltas = []
        for index, completion in enumerate(self.completions):
            ended = completion.finish_reason is not None
            if completion.finish_sent or (waiting_for_prompt and not ended):
                continue
            text = completion.tracker.final_text() if ended else completion.tracker.text
            end = len(text) if ended else max(completion.sent_text, len(text) - self.hold_back)
            tokens = len(completion.token_ids)
            if end == completion.sent_text and tokens == completion.sent_tokens and not ended:
                continue
            start = completion.sent_tokens
            logprobs = completion.logprobs
            deltas.append(
                CompletionOutput(
                    index=index,
                    text=text[completion.sent_text : end],
                    token_ids=completion.token_ids[start:],
                    exit_depths=completion.exit_depths[start:],
                    logprobs=None if logprobs is None else logprobs[start:],
                    finish_reason=completion.finish_reason,
                    cumulative_logprob=completion.cumulative_logprob if ended else None,
                    stop_reason=completion.stop_reason,
                )
            )
            completion.sent_text, completion.sent_tokens = end, tokens
            completion.finish_sent = ended
        return deltas
