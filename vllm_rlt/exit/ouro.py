"""The `ouro` policy: the checkpoint's exit gate read as a hazard, its CDF against q."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vllm_rlt.config import ExitConfig, ParamError
from vllm_rlt.exit.policy import ExitDecision, ExitInputs, ExitPolicy


class OuroPolicy(ExitPolicy):
    """Exit after loop r when r = max_loops, or q < 1, r >= min_loops and F_r >= q."""

    delayed = False
    fresh = {"survival": 1.0}  # product of (1 - hazard) over the token's loops so far

    def __init__(self, score: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.score = score  # hidden [rows, hidden] -> float32 gate logits [rows]

    @classmethod
    def from_config(cls, config: ExitConfig, model: Any) -> OuroPolicy:
        gate = getattr(model, "gate", None)
        if gate is None:
            raise ParamError(
                f"exit mode {config.mode!r} reads the checkpoint's exit gate, which this "
                f"model has none of: use {model.exit_policy!r} (mode 'auto') or 'trace'",
                "exit_mode",
            )
        return cls(gate)

    def decide(self, x: ExitInputs) -> ExitDecision:
        hazard = torch.sigmoid(self.score(x.hidden))
        survival = x.carried["survival"] * (1.0 - hazard)
        cdf = 1.0 - survival
        trigger = (
            (x.exit_threshold < 1.0) & (x.loops_done >= x.min_loops) & (cdf >= x.exit_threshold)
        )
        at_max = x.loops_done >= x.max_loops
        if not self.delayed:
            return ExitDecision(at_max | trigger, {"survival": survival})
        leave = at_max | x.carried["pending"]
        return ExitDecision(leave, {"survival": survival, "pending": trigger & ~leave})
