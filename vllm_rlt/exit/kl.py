"""The `kl` policy: Huginn's KL criterion. After loop r, once the request's min_loops allow
a check (r >= min_loops), the row exits when KL(p_ref || p_r) falls below its
exit_threshold, p_r the next-token distribution read out of the state now and p_ref that
of the previous check (uniform before the first); max_loops caps the depth. An
exit_threshold of 0 never exits early.

Cost per loop: the readout layers and the LM head run for every decode row (the pass head
computes the logits before the exit decision and samples from them), a log-softmax over
the vocabulary, and one [vocab] float32 vector per slot kept between loops.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from vllm_rlt.config import ExitConfig
from vllm_rlt.exit.policy import ExitDecision, ExitInputs, ExitPolicy


class KLPolicy(ExitPolicy):
    """Exit after loop r when r = max_loops, or r >= min_loops and the KL divergence of
    this loop's next-token distribution from the previous check's is below the row's
    threshold."""

    needs_logits = True

    def __init__(self, vocab: int) -> None:
        self.fresh = {"reference": -math.log(vocab)}  # log-probs of the uniform distribution
        self.widths = {"reference": vocab}

    @classmethod
    def from_config(cls, config: ExitConfig, model: Any) -> KLPolicy:
        return cls(model.config.vocab_size)

    def decide(self, x: ExitInputs) -> ExitDecision:
        log_probs = torch.log_softmax(x.logits.float(), dim=-1)
        first = (x.loops_done == 1).unsqueeze(1)
        reference = torch.where(first, self.fresh["reference"], x.carried["reference"])
        kl = (reference.exp() * (reference - log_probs)).sum(dim=-1)
        checked = x.loops_done >= x.min_loops
        # rounding can take a KL of equal distributions below 0: a threshold of 0 never exits
        leave = (checked & (x.exit_threshold > 0) & (kl < x.exit_threshold)) | (
            x.loops_done >= x.max_loops
        )
        reference = torch.where(checked.unsqueeze(1), log_probs, reference)
        return ExitDecision(leave, {"reference": reference})
