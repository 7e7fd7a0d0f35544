"""Logit adjustments before sampling, batched on the device, in vLLM's order: logit_bias,
then the repetition penalty, then the frequency and presence penalties; then bad words."""

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


def apply_bad_words(
    logits: torch.Tensor,  # [rows, vocab] float32
    recent: torch.Tensor,  # [rows, K] int64: the last K output tokens, -1 before the first
    prefixes: torch.Tensor,  # [rows, W, K] int64: each word but its last token, -1 padded left
    last_tokens: torch.Tensor,  # [rows, W] int64: each word's last token, -1 for no word
) -> torch.Tensor:
    """Bar each bad word's last token where the output so far ends with the rest of the
    word (a one-token word is barred always). A row without words keeps its logits."""
    matches = ((prefixes == recent.unsqueeze(1)) | (prefixes < 0)).all(-1) & (last_tokens >= 0)
    barred = torch.zeros_like(logits).scatter_add_(1, last_tokens.clamp(min=0), matches.float())
    return logits.masked_fill(barred > 0, float("-inf"))
