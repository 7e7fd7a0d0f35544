"""Turns sampled tokens into text and decides when a request stops."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_rlt.core.request import Request
from vllm_rlt.outputs import CompletionOutput
from vllm_rlt.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class CompletionState:
    """Text state of one completion: detokenizer, visible text, and the stop verdict."""

    detokenizer: IncrementalDetokenizer
    text: str = ""
    finish_reason: str | None = None
    num_seen: int = 0
    stopped_by_string: bool = False


class OutputProcessor:
    """Detokenizes incrementally and applies EOS, stop ids, stop strings and length limits."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, CompletionState] = {}

    def add(self, request: Request) -> None:
        detok = (
            IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids)
            if self.tokenizer is not None
            else None
        )
        self.states[request.request_id] = CompletionState(detok)  # type: ignore[arg-type]

    def drop(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def process(self, request: Request) -> str | None:
        """Consume the request's new tokens; return a finish reason when it must stop."""
        state = self.states[request.request_id]
        params = request.params
        while state.num_seen < len(request.output_token_ids):
            token = request.output_token_ids[state.num_seen]
            state.num_seen += 1
            count = state.num_seen
            previous_len = len(state.text)
            if state.detokenizer is not None:
                state.text += state.detokenizer.add(token)
            if count >= params.min_tokens:
                if token in request.eos_token_ids or token in params.stop_token_ids:
                    return "stop"
                if params.stop and self._cut_at_stop(state, params.stop, previous_len):
                    state.stopped_by_string = True
                    return "stop"
            if count >= params.max_tokens:
                return "length"
        return None

    @staticmethod
    def _cut_at_stop(state: CompletionState, stops: list[str], previous_len: int) -> bool:
        """Truncate the text before the earliest stop string; the stop text is not returned.
        Only the tail that the new token could have completed is searched."""
        hits = [state.text.find(stop, max(0, previous_len - len(stop) + 1)) for stop in stops]
        hits = [index for index in hits if index >= 0]
        if not hits:
            return False
        state.text = state.text[: min(hits)]
        return True

    def completion(
        self, request: Request, index: int, finish_reason: str | None
    ) -> CompletionOutput:
        state = self.states[request.request_id]
        text = state.text
        if (
            finish_reason is not None
            and state.detokenizer is not None
            and not state.stopped_by_string
        ):
            text += state.detokenizer.flush()
            state.text = text
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
