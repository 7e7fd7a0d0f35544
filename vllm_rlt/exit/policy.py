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
    carried: dict[str, torch.Tensor]  # [rows] or [rows, width]: values from earlier loops
    positions: torch.Tensor | None = None  # [rows] int64, the position each row computes
    seeds: torch.Tensor | None = None  # [rows] int64, its request's seed
    logits: torch.Tensor | None = None  # [rows, vocab] float32, for a policy `needs_logits`


@dataclass
class ExitDecision:
    exit: torch.Tensor  # [rows] bool
    carried: dict[str, torch.Tensor]  # [rows] each: the values the next loop starts from


class ExitPolicy:
    """An exit rule and the per-slot state it keeps.

    `fresh` names the values a policy carries from one loop of a token to the next, each
    at its value when a token starts, and `widths` the width of those that are vectors
    per slot (a state, a distribution); `bind` allocates them per slot, and the pass head
    gathers them (`gather`) into `decide` and writes what it decides back (`store`).
    `admit` writes what a policy keeps of a newly admitted request; `start` sets rows
    that begin a token (an admitted slot, a speculation lane that restarts) fresh.
    A policy that `needs_logits` is given the decode rows' next-token logits every loop
    (the pass head computes them for every decode row first)."""

    fresh: dict[str, float | bool] = {}
    widths: dict[str, int] = {}
    needs_logits = False
    needs_seeds = False  # reads ExitInputs.seeds (otherwise None: no gather in the pass)

    def bind(self, num_slots: int, device: torch.device) -> None:
        """Allocate the per-slot state of `num_slots` slots."""
        self.carried = {
            name: torch.full(
                (num_slots, self.widths[name]) if name in self.widths else (num_slots,),
                value,
                dtype=torch.bool if isinstance(value, bool) else torch.float32,
                device=device,
            )  # [slots] or [slots, width]
            for name, value in self.fresh.items()
        }

    def admit(self, news: Sequence[NewSlot], slots: torch.Tensor, send: Upload) -> None:
        """Newly admitted requests (`news`, in `slots` on the device) start their first
        token fresh; `send` uploads what else a policy keeps of them."""
        self.start(slots)

    def start(self, slots: torch.Tensor) -> None:
        for name, table in self.carried.items():
            table.index_fill_(0, slots, self.fresh[name])  # no host copy inside a graph

    def gather(self, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: table[slots] for name, table in self.carried.items()}

    def store(
        self, slots: torch.Tensor, carried: dict[str, torch.Tensor], exited: torch.Tensor
    ) -> None:
        """Write rows' carried values back; a row whose token exited starts the next fresh."""
        for name, values in carried.items():
            restart = exited.view(-1, *([1] * (values.dim() - 1)))
            self.carried[name][slots] = torch.where(restart, self.fresh[name], values)

    def decide(self, x: ExitInputs) -> ExitDecision:
        raise NotImplementedError
