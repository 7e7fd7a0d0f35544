"""Exits held back so they come together (ExitConfig.sync_passes), for models with layers
after the loop (Huginn's coda).

A pass in which any decode row exits streams the coda's and the LM head's weights (their
products skip only row tiles without an exiting row), so under steady load, where a few
rows exit in nearly every pass, a pass costs the looped block plus all of those. Here a
row whose exit policy says "exit" is held back instead, frozen, until a pass in which
every decode row wants to exit or one of the held rows has waited `sync_passes - 1`
passes; then every held row exits in that pass. A held row keeps its state, its loop and
its policy values, writes no K/V, and discards what the pass computes for it: running its
last loop again, it meets the same decision, and it exits at the depth it chose, from the
state it had, so tokens, logprobs and exit depths are those of exiting at once. What it
costs is time: a held row's slot idles for up to `sync_passes - 1` passes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_rlt.worker.slot_state import SlotState


@dataclass
class SyncedExits:
    """A pass's decode rows after the hold: those that exit now and those held back."""

    exit: torch.Tensor  # [decode rows] bool
    held_back: torch.Tensor | None  # [decode rows] bool (None: exits are not held)


class ExitSync:
    """Which decode rows exit now and which wait (module docstring); the per-slot count of
    passes waited lives in the slot state (`SlotState.exit_wait`)."""

    def __init__(self, passes: int, state: SlotState, dummy_slot: int) -> None:
        assert state.exit_wait is not None, "the slot state keeps no exit_wait column"
        self.passes, self.state, self.dummy_slot = passes, state, dummy_slot

    def frozen(self, carried: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """`carried` [rows, width] of a pass's rows, with a held row's replaced by what it
        carried into the pass (what the pass computed for it is discarded)."""
        st = self.state
        held = (st.exit_wait[slots] > 0).unsqueeze(1)
        return torch.where(held, st.hidden[slots], carried)

    def decide(self, wants: torch.Tensor, slots: torch.Tensor) -> SyncedExits:
        """`wants` [rows] bool, the policy's exits of the decode rows in `slots` (padding
        rows on the dummy slot): all wanting rows exit when every real row wants to or one
        has waited long enough; otherwise they wait. Graph-safe (no host reads)."""
        waited = self.state.exit_wait[slots]
        wants = wants | (waited > 0)  # a held row exits in the end, whatever it meets
        real = slots != self.dummy_slot
        due = (wants & real & (waited >= self.passes - 1)).any()
        together = (wants | ~real).all()
        leave = wants & (due | together)
        return SyncedExits(leave, wants & ~leave)

    def store(self, slots: torch.Tensor, held_back: torch.Tensor) -> None:
        """Count one more pass waited for the held rows; every other row waits none."""
        waited = self.state.exit_wait
        waited[slots] = torch.where(held_back, waited[slots] + 1, 0)
