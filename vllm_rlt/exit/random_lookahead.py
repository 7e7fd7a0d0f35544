"""The `random_lookahead` policy: a frozen random head, never from the checkpoint."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vllm_rlt.config import ExitConfig
from vllm_rlt.exit.policy import ExitDecision, ExitInputs, ExitPolicy


class RandomLookaheadPolicy(ExitPolicy):
    """sigmoid(head) >= q means "exit after one more loop"; earliest exit 2."""

    fresh = {"pending": False}  # a trigger fired on the last loop

    def __init__(self, score: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.score = score  # hidden [rows, hidden] -> float32 logits [rows]

    @classmethod
    def from_config(cls, config: ExitConfig, model: Any) -> RandomLookaheadPolicy:
        """The head drawn from `config.seed`, so a run repeats with the same seed."""
        hidden = model.config.hidden_size
        generator = torch.Generator().manual_seed(config.seed)
        weight = (torch.randn(hidden, generator=generator) / hidden**0.5).to(
            device=model.device, dtype=model.dtype
        )  # [hidden]
        bias = float(torch.randn((), generator=generator))
        return cls(lambda h: (h @ weight).float() + bias)

    def decide(self, x: ExitInputs) -> ExitDecision:
        score = torch.sigmoid(self.score(x.hidden))
        trigger = (
            (x.exit_threshold < 1.0)
            & (score >= x.exit_threshold)
            & (x.loops_done + 1 >= x.min_loops)
        )
        leave = (x.loops_done >= x.max_loops) | x.carried["pending"]
        return ExitDecision(leave, {"pending": trigger & ~leave})
