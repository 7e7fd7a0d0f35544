"""Logit adjustments before sampling, batched on the device, in vLLM's order: logit_bias,
then the repetition penalty, then the frequency and presence penalties."""

from __future__ import annotations

import torch


def apply_penalties(
    logits: torch.Tensor,  # [rows, vocab] float32
    output_counts: torch.Tensor,  # [rows, vocab] int: each token's count among the outputs
    prompt_mask: torch.Tensor,  # [rows, vocab] bool: tokens of the prompt
    repetition: torch.Tensor,  # [rows] float32, 1 = off
    frequency: torch.Tensor,  # [rows] float32, 0 = off
    presence: torch.Tensor,  # [rows] float32, 0 = off
    bias: torch.Tensor,  # [rows, vocab] float32, 0 = off
) -> torch.Tensor:
    """A token seen in the prompt or the outputs has its logit divided by the repetition
    penalty if positive, multiplied if not; then each output occurrence subtracts the
    frequency penalty and any occurrence the presence penalty. A row with every value off
    keeps its logits bit for bit."""
    logits = logits + bias
    seen = output_counts > 0
    factor = repetition.unsqueeze(1)
    repeated = torch.where(logits > 0, logits / factor, logits * factor)
    logits = torch.where(seen | prompt_mask, repeated, logits)
    counts = output_counts.to(logits.dtype)
    return logits - frequency.unsqueeze(1) * counts - presence.unsqueeze(1) * seen.to(logits.dtype)
