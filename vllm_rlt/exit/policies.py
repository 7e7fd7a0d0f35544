"""The four decode exit policies (docs/design.md §3.4), vectorised over rows, on the device."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class ExitInputs:
    """Per-row state after a row finished loop `loops_done` (1-based) of its token."""

    hidden: torch.Tensor  # [rows, hidden] end-of-loop normalised state
    loops_done: torch.Tensor  # [rows] int64
    min_loops: torch.Tensor  # [rows] int64
    max_loops: torch.Tensor  # [rows] int64
    exit_threshold: torch.Tensor  # [rows] float32
    survival: torch.Tensor  # [rows] float32, product of (1 - hazard) so far
    pending: torch.Tensor  # [rows] bool, a delayed trigger fired on the previous loop
    target_depth: torch.Tensor  # [rows] int64, trace depth (unused by other policies)


@dataclass
class ExitDecision:
    exit: torch.Tensor  # [rows] bool
    survival: torch.Tensor  # [rows] float32
    pending: torch.Tensor  # [rows] bool


class ExitPolicy:
    """Base: `score(hidden)` gives float32 logits [rows]; `decide` applies the rule."""

    def __init__(self, score: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.score = score

    def decide(self, x: ExitInputs) -> ExitDecision:
        raise NotImplementedError


class OuroPolicy(ExitPolicy):
    """Exit after loop r when r = max_loops, or q < 1, r >= min_loops and F_r >= q."""

    delayed = False

    def decide(self, x: ExitInputs) -> ExitDecision:
        hazard = torch.sigmoid(self.score(x.hidden))
        survival = x.survival * (1.0 - hazard)
        cdf = 1.0 - survival
        trigger = (
            (x.exit_threshold < 1.0) & (x.loops_done >= x.min_loops) & (cdf >= x.exit_threshold)
        )
        at_max = x.loops_done >= x.max_loops
        if not self.delayed:
            return ExitDecision(at_max | trigger, survival, torch.zeros_like(trigger))
        leave = at_max | x.pending
        return ExitDecision(leave, survival, trigger & ~leave)


class OuroDelayedPolicy(OuroPolicy):
    """The same CDF, but a trigger at loop r exits after loop r + 1."""

    delayed = True


class RandomLookaheadPolicy(ExitPolicy):
    """sigmoid(frozen random head) >= q means "exit after one more loop"; earliest exit 2."""

    def decide(self, x: ExitInputs) -> ExitDecision:
        score = torch.sigmoid(self.score(x.hidden))
        trigger = (
            (x.exit_threshold < 1.0)
            & (score >= x.exit_threshold)
            & (x.loops_done + 1 >= x.min_loops)
        )
        leave = (x.loops_done >= x.max_loops) | x.pending
        return ExitDecision(leave, x.survival, trigger & ~leave)


class TracePolicy(ExitPolicy):
    """Replay recorded depths (validated at admission to lie within the request's bounds)."""

    def decide(self, x: ExitInputs) -> ExitDecision:
        leave = (x.loops_done >= x.target_depth) | (x.loops_done >= x.max_loops)
        return ExitDecision(leave, x.survival, x.pending)


EXIT_POLICIES: dict[str, type[ExitPolicy]] = {
    "ouro": OuroPolicy,
    "ouro_delayed": OuroDelayedPolicy,
    "random_lookahead": RandomLookaheadPolicy,
    "trace": TracePolicy,
}


def make_exit_policy(mode: str, model, seed: int) -> ExitPolicy:
    """Build the policy; random_lookahead gets its own frozen head, never from the checkpoint."""
    if mode == "random_lookahead":
        hidden = model.config.hidden_size
        generator = torch.Generator().manual_seed(seed)
        weight = (torch.randn(hidden, generator=generator) / hidden**0.5).to(
            device=model.device, dtype=model.dtype
        )  # [hidden]
        bias = float(torch.randn((), generator=generator))
        return RandomLookaheadPolicy(lambda h: (h @ weight).float() + bias)
    return EXIT_POLICIES[mode](model.gate)
