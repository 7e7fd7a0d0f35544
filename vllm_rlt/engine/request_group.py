"""A user request inside the engine: its n completions run as separate engine requests,
and each step reports what changed since the last one (`delta`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_rlt.core.request import Request
from vllm_rlt.engine.messages import CompletionDelta, RequestDelta
from vllm_rlt.outputs import prompt_logprob_entries


@dataclass
class RequestGroup:
    """A user request: its n completions run as separate engine requests."""

    request_id: str
    prompt_token_ids: list[int]
    children: list[Request]
    finish_reasons: dict[int, str] = field(default_factory=dict)
    error: str | None = None  # why the engine failed this request alone
    sent: list[int] = field(default_factory=list)  # tokens already sent, per completion
    finish_sent: set[int] = field(default_factory=set)  # completions whose end was sent
    prompt_logprobs_sent: bool = False

    def prompt_logprobs(self) -> list[dict[int, float] | None] | None:
        """From the first completion, which alone computes them (see Request)."""
        first = self.children[0]
        if first.prompt_logprobs is None:
            return None
        return prompt_logprob_entries(self.prompt_token_ids, first.prompt_logprob_values)

    @property
    def all_ended(self) -> bool:
        return len(self.finish_reasons) >= len(self.children)

    def delta(self) -> RequestDelta:
        """What changed since the last delta: new tokens, finish reasons not yet sent, and
        the prompt logprobs once."""
        if not self.sent:
            self.sent = [0] * len(self.children)
        completions = []
        for index, child in enumerate(self.children):
            start, end = self.sent[index], len(child.output_token_ids)
            reason = self.finish_reasons.get(index)
            if start == end and (reason is None or index in self.finish_sent):
                continue
            self.sent[index] = end
            if reason is not None:
                self.finish_sent.add(index)
            with_logprobs = child.params.logprobs is not None
            completions.append(
                CompletionDelta(
                    index=index,
                    start=start,
                    token_ids=child.output_token_ids[start:end],
                    exit_depths=child.exit_depths[start:end],
                    logprobs=child.logprobs[start:end] if with_logprobs else None,
                    top_logprobs=[list(top) for top in child.top_logprobs[start:end]]
                    if with_logprobs
                    else None,
                    finish_reason=reason,
                )
            )
        prompt_logprobs = None
        if not self.prompt_logprobs_sent:
            prompt_logprobs = self.prompt_logprobs()
            self.prompt_logprobs_sent = prompt_logprobs is not None
        return RequestDelta(
            self.request_id,
            completions,
            self.all_ended,
            error=self.error,
            prompt_logprobs=prompt_logprobs,
        )
