"""Prompt logprobs: the LM head on the prompt rows that ask for them, on the device, and
what reaches the host of them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_rlt.core.contract import PrefillChunk, PromptLogprobs
from vllm_rlt.layers.sampler import token_logprobs
from vllm_rlt.models.interface import LoopedModel
from vllm_rlt.ops.base import LoopOps

# Prompt rows whose logits are held at once for prompt logprobs ([rows, vocab] float32).
PROMPT_LOGPROB_ROWS = 256


@dataclass
class PromptRows:
    """Prompt logprobs of one chunk: [targets, 2 + 2 * top] (logprob, rank, top ids, values)."""

    slot: int
    start: int  # position of the first target
    top: int
    values: torch.Tensor


def prompt_rows(
    model: LoopedModel,
    ops: LoopOps,
    hidden: torch.Tensor,
    chunks: tuple[PrefillChunk, ...],
    row: int,
) -> list[PromptRows]:
    """The LM head on the prompt rows whose next token's logprob was asked for (and on
    no others), a bounded number of rows at a time."""
    results = []
    for chunk in chunks:
        count = len(chunk.prompt_targets)
        if count:
            targets = torch.tensor(chunk.prompt_targets, device=hidden.device)
            parts = []
            for lo in range(0, count, PROMPT_LOGPROB_ROWS):
                hi = min(count, lo + PROMPT_LOGPROB_ROWS)
                logits = model.coda(hidden[row + lo : row + hi], ops)
                chosen, rank, top_ids, top_lp = token_logprobs(
                    logits, targets[lo:hi], chunk.prompt_top
                )
                firsts = [chosen.unsqueeze(1), rank.float().unsqueeze(1)]
                parts.append(torch.cat([*firsts, top_ids.float(), top_lp], 1))
            values = torch.cat(parts)
            results.append(PromptRows(chunk.slot, chunk.start + 1, chunk.prompt_top, values))
        row += len(chunk.token_ids)
    return results


def prompt_logprobs(rows: PromptRows) -> PromptLogprobs:
    """One chunk's prompt logprobs as the engine reads them, from their copy on the host."""
    values = rows.values.tolist()
    top = rows.top
    return PromptLogprobs(
        slot=rows.slot,
        start=rows.start,
        logprobs=tuple(v[0] for v in values),
        ranks=tuple(int(v[1]) for v in values),
        top=tuple(tuple((int(v[2 + j]), v[2 + top + j]) for j in range(top)) for v in values),
    )
