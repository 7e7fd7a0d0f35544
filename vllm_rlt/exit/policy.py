"""What an exit policy is given, what it decides, and the interface every policy has
(docs/design.md §3.4): all vectorised over a pass's decode rows, on the device."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from vllm_rlt.core.contract import NewSlot

Upload = Callable[[torch.Tensor], torch.Tensor]  # an int64 host tensor, sent to the device


@dataclass
class ExitInputs:
    """Per-row values after a row finished loop `loops_done` (1-based) of its token."""

    hidden: torch.Tensor  # [rows, hidden] end-of-loop normalised state
    slots: torch.Tensor  # [rows] int64, where a policy keeps its per-row state
    num_generated: torch.Tensor  # [rows] int64, tokens the row's request sampled before
    loops_done: torch.Tensor  # [rows] int64
    min_loops: torch.Tensor  # [rows] int64
    max_loops: torch.Tensor  # [rows] int64
    exit_threshold: torch.Tensor  # [rows] float32
    survival: torch.Tensor  # [rows] float32, product of (1 - hazard) so far
    pending: torch.Tensor  # [rows] bool, a delayed trigger fired on the previous loop


@dataclass
class ExitDecision:
    exit: torch.Tensor  # [rows] bool
    survival: torch.Tensor  # [rows] float32
    pending: torch.Tensor  # [rows] bool


class ExitPolicy:
    """An exit rule. A policy that keeps something per slot allocates it in `bind` and
    writes a newly admitted request's part in `admit`; `decide` rules on a pass's rows."""

    def bind(self, num_slots: int, device: torch.device) -> None:
        """Allocate per-slot state for `num_slots` slots (none by default)."""

    def admit(self, news: Sequence[NewSlot], send: Upload) -> None:
        """Write the per-slot state of newly admitted requests (none by default)."""

    def decide(self, x: ExitInputs) -> ExitDecision:
        raise NotImplementedError
