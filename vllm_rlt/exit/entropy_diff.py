"""The `entropy_diff` policy: Huginn's entropy criterion. After loop r, once the request's
min_loops allow a check (r >= min_loops), the row exits when the entropy of its next-token
distribution changed by less than its exit_threshold since the previous check (from 100
before the first, as Huginn starts it); max_loops caps the depth. An exit_threshold of 0
never exits early.

Cost per loop: the readout layers and the LM head run for every decode row (the pass head
computes the logits before the exit decision and samples from them), a softmax over the
vocabulary, and one number per slot kept between loops.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_rlt.config import ExitConfig
from vllm_rlt.exit.policy import ExitDecision, ExitInputs, ExitPolicy

START = 100.0  # the entropy a token's first check is compared with (Huginn's)


class EntropyDiffPolicy(ExitPolicy):
    """Exit after loop r when r = max_loops, or r >= min_loops and the next-token
    entropy moved by less than the row's threshold since the previous check."""

    needs_logits = True
    fresh = {"entropy": START}

    @classmethod
    def from_config(cls, config: ExitConfig, model: Any) -> EntropyDiffPolicy:
        return cls()

    def decide(self, x: ExitInputs) -> ExitDecision:
        probs = torch.softmax(x.logits.float(), dim=-1)
        entropy = -(probs * torch.log(probs + 1e-10)).sum(dim=-1)  # Huginn's epsilon
        previous = torch.where(x.loops_done == 1, START, x.carried["entropy"])
        checked = x.loops_done >= x.min_loops
        change = (entropy - previous).abs()
        leave = (checked & (change < x.exit_threshold)) | (x.loops_done >= x.max_loops)
        return ExitDecision(leave, {"entropy": torch.where(checked, entropy, previous)})
