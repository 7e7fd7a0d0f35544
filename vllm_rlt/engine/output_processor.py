"""Turns sampled tokens into text and decides when a request stops."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_rlt.core.request import Request
from vllm_rlt.outputs import CompletionOutput
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
        self.stopped = False
        self._flushed = False

    def add(self, token: int, check_stops: bool) -> bool:
        """Append one token; True once a stop string has ended the text."""
        previous = len(self.text)
        if self.detokenizer is not None:
            self.text += self.detokenizer.add(token)
        if check_stops and self.stops and not self.stopped:
            hits = [
                (index, -len(stop))
                for stop in self.stops
                if (index := self.text.find(stop, max(0, previous - len(stop) + 1))) >= 0
            ]
            if hits:
                index, negative_length = min(hits)  # the earliest, then the longest
                self.text = self.text[: index - negative_length if self.include_stop else index]
                self.stopped = True
        return self.stopped

    def final_text(self) -> str:
        """The text once generation ended: held-back bytes are flushed, unless a stop
        string cut the text."""
        if not self._flushed and not self.stopped and self.detokenizer is not None:
            self.text += self.detokenizer.flush()
            self._flushed = True
        return self.text


@dataclass
class CompletionState:
    tracker: TextTracker
    num_seen: int = 0


class OutputProcessor:
    """Builds each completion's text and applies stop strings.

    With `make_text=False` (the server, which detokenizes on its own thread) it does
    nothing: text and stop strings are left to the caller.
    """

    def __init__(self, tokenizer: Tokenizer | None, make_text: bool = True) -> None:
        self.tokenizer = tokenizer if make_text else None
        self.make_text = make_text
        self.states: dict[str, CompletionState] = {}

    def add(self, request: Request) -> None:
        params = request.params
        stops = params.stop if self.make_text else []
        tracker = TextTracker(
            self.tokenizer,
            request.prompt_token_ids,
            stops,  # type: ignore[arg-type]
            params.include_stop_str_in_output,
            params.skip_special_tokens,
            params.spaces_between_special_tokens,
        )
        self.states[request.request_id] = CompletionState(tracker)

    def drop(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def process(self, request: Request) -> str | None:
        """Turn the request's new tokens into text; "stop" when a stop string ended it. The
        stops on token ids were decided when the tokens arrived (core/stopping.py)."""
        state = self.states[request.request_id]
        if not self.make_text:
            state.num_seen = len(request.output_token_ids)
            return None
        min_tokens = request.params.min_tokens
        while state.num_seen < len(request.output_token_ids):
            token = request.output_token_ids[state.num_seen]
            state.num_seen += 1
            if state.tracker.add(token, check_stops=state.num_seen >= min_tokens):
                return "stop"
        return None

    def completion(
        self, request: Request, index: int, finish_reason: str | None
    ) -> CompletionOutput:
        tracker = self.states[request.request_id].tracker
        text = tracker.final_text() if finish_reason is not None else tracker.text
        logprobs = None
        if request.params.logprobs is not None:
            logprobs = []
            for token, chosen, top in zip(
                request.output_token_ids, request.logprobs, request.top_logprobs, strict=True
            ):
                entry = dict(top)
                entry[token] = chosen
                logprobs.append(entry)
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=list(request.output_token_ids),
            exit_depths=list(request.exit_depths),
            logprobs=logprobs,
            finish_reason=finish_reason,
            cumulative_logprob=sum(request.logprobs) if request.logprobs else None,
        )
