"""How a request the engine core accepts becomes its `RequestGroup`: the checks that depend
on configuration, and the settings every completion carries (loop bounds, exit threshold,
EOS ids, whether it decodes in speculation lanes, its seed)."""

from __future__ import annotations

import random

from vllm_rlt.config import SpeculativeConfig
from vllm_rlt.engine.request_checks import RequestChecker
from vllm_rlt.engine.request_group import RequestGroup
from vllm_rlt.engine.samplable import check_samplable
from vllm_rlt.sampling_params import SamplingParams


class RequestIntake:
    def __init__(
        self,
        checker: RequestChecker,
        eos_token_ids: frozenset[int],
        exit_threshold: float,
        speculative_config: SpeculativeConfig | None,
        seed: int | None,
    ) -> None:
        self.checker = checker
        self.eos_token_ids = eos_token_ids
        self.exit_threshold = exit_threshold  # the model's, for requests that give none
        self.speculative_config = speculative_config
        self.seeds = random.Random(seed)  # of completions whose request gives none

    def check(self, request_id: str, prompt: list[int], params: SamplingParams) -> tuple[int, int]:
        """Every check that depends only on configuration: returns (min_loops, max_loops)."""
        checked = self.checker.check(request_id, prompt, params)
        check_samplable(params, self.checker.limits.vocab_size, self.eos_token_ids)
        return checked

    def group(self, request_id: str, prompt: list[int], params: SamplingParams) -> RequestGroup:
        """The checked group of a new request (ParamError names a bad field)."""
        min_loops, max_loops = self.check(request_id, prompt, params)
        return RequestGroup.start(
            request_id,
            prompt,
            params,
            self.seeds,
            min_loops=min_loops,
            max_loops=max_loops,
            exit_threshold=float(
                self.exit_threshold if params.exit_threshold is None else params.exit_threshold
            ),
            eos_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids,
            speculates=self._speculates(params, max_loops),
        )

    def _speculates(self, params: SamplingParams, max_loops: int) -> bool:
        """Whether a request decodes in speculation lanes: its depth may exceed the draft's,
        and it has no logit adjustments (their counts of earlier tokens live per slot, and
        a lane would count unverified drafts). Others decode loop by loop as usual."""
        config = self.speculative_config
        return config is not None and config.draft_loops < max_loops and not params.adjusts_logits
