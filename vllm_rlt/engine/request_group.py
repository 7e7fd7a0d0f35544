"""A user request inside the engine: its n completions run as separate engine requests,
and each step reports what changed since the last one (`delta`)."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from vllm_rlt.config import require
from vllm_rlt.core.request import Request, RequestStatus
from vllm_rlt.core.scheduler import Scheduler
from vllm_rlt.core.stopping import stop_token
from vllm_rlt.engine.core_outputs import CompletionDelta, RequestDelta
from vllm_rlt.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def completion_ids(request_id: str, n: int) -> list[str]:
    """The engine request ids of a user request's n completions."""
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]


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
    handover: bool = False  # ends here once prefilled, to decode on another core

    @property
    def ready_to_hand_over(self) -> bool:
        """One completion still runs, and each has ended or decodes with its first token
        (not one that a preemption sent back to wait or to replay what it computed)."""
        children = self.children
        return not self.all_ended and all(
            child.is_finished or (child.status is RequestStatus.DECODE and child.output_token_ids)
            for child in children
        )

    @classmethod
    def start(
        cls,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seeds: random.Random,
        **settings,
    ) -> RequestGroup:
        """The group of a checked request: one engine request per completion with the
        request's `settings` (loop bounds, threshold, EOS, speculation), each its own seed
        ((params.seed + index) mod 2**63, or a draw from `seeds`); only the first computes
        prompt logprobs."""
        now = time.monotonic()
        children = [
            Request(
                request_id=child_id,
                prompt_token_ids=list(prompt_token_ids),
                params=params,
                seed=seeds.getrandbits(63)
                if params.seed is None
                else (params.seed + index) % 2**63,
                prompt_logprobs=params.prompt_logprobs if index == 0 else None,
                stop_token_ids=frozenset(params.stop_token_ids),
                arrival_time=now,
                **settings,
            )
            for index, child_id in enumerate(completion_ids(request_id, params.n))
        ]
        return cls(request_id, list(prompt_token_ids), children)

    def prompt_logprobs(self) -> list[tuple[float, int, list[tuple[int, float]]]] | None:
        """From the first completion, which alone computes them (see Request): per prompt
        position from the second, (logprob, rank, top); None until each has its value."""
        first, length = self.children[0], len(self.prompt_token_ids)
        values = first.prompt_logprob_values
        if first.prompt_logprobs is None or len(values) < length - 1:
            return None
        return [
            (chosen, rank, list(top)) for chosen, rank, top in map(values.get, range(1, length))
        ]

    def end(self, scheduler, reason: str, index: int | None = None) -> None:
        """End completion `index` (None: every one) that still runs, with `reason`."""
        for position, child in enumerate(self.children):
            if (index is None or position == index) and not child.is_finished:
                scheduler.finish(child, reason)
                self.finish_reasons[position] = reason

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
                    ranks=child.ranks[start:end] if with_logprobs else None,
                    stop_token=stop_token(child) if reason == "stop" else None,
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
            num_cached_tokens=self.children[0].num_cached_tokens,
        )


class RequestGroups:
    """The user requests one engine core runs, by id, and the group each of their engine
    requests (one per completion, run by `scheduler`) belongs to. Iterating yields the
    user request ids."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._groups: dict[str, RequestGroup] = {}
        self._group_of: dict[str, str] = {}  # engine request id -> user request id

    def __iter__(self) -> Iterator[str]:
        return iter(self._groups)

    def __len__(self) -> int:
        return len(self._groups)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._groups

    def get(self, request_id: str) -> RequestGroup | None:
        return self._groups.get(request_id)

    def of(self, request: Request) -> RequestGroup:
        """The group an engine request belongs to."""
        return self._groups[self._group_of[request.request_id]]

    def require_free(self, request_id: str, n: int) -> None:
        """A new request's id, and each of its completion ids, must be unused."""
        for used in [request_id, *completion_ids(request_id, n)]:
            require(
                used not in self._groups and used not in self._group_of,
                f"request_id {request_id!r} is already in use"
                + ("" if used == request_id else f" (its completion id {used!r} is taken)"),
            )

    def queue(self, group: RequestGroup, children: list[Request]) -> None:
        """Add `group`, its `children` (its completions that run) queued to run."""
        self._groups[group.request_id] = group
        for child in group.children:
            self._group_of[child.request_id] = group.request_id
        for child in children:
            self.scheduler.add_request(child)

    def remove(self, group: RequestGroup) -> None:
        if self._groups.pop(group.request_id, None) is not None:
            for child in group.children:
                del self._group_of[child.request_id]

    def delta(self, group: RequestGroup) -> RequestDelta:
        """What changed in `group` since its last delta; a group whose completions have all
        ended is dropped."""
        delta = group.delta()
        if group.all_ended:
            self.remove(group)
        return delta

    def fail(self, request: Request, error: BaseException) -> RequestGroup:
        """End a request's whole group (its completions share one prompt) with the error."""
        group = self.of(request)
        logger.error(
            "request %s failed; the engine keeps running",
            group.request_id,
            exc_info=(type(error), error, error.__traceback__),
        )
        group.end(self.scheduler, "abort")
        group.error = f"{type(error).__name__}: {error}"
        return group

    def record(self, touched: list[Request], now: float) -> list[RequestGroup]:
        """The groups of the requests a pass gave a token (`Scheduler.update`) at time
        `now`; a completion whose token stopped it ends."""
        progressed = []
        for request in touched:
            if request.is_finished:
                continue  # a sibling's failure ended its group within this step
            if request.first_token_time is None:
                request.first_token_time = now
            group = self.of(request)
            if request.stop_reason is not None:
                group.end(self.scheduler, request.stop_reason, group.children.index(request))
            progressed.append(group)
        return progressed
