"""The `latent_diff` policy: Huginn's latent convergence. After loop r, once the request's
min_loops allow a check (r >= min_loops), the row exits when the state's relative change
||s_r - s_ref|| / ||s_r|| falls below its exit_threshold, s_ref the state at the previous
check (the token's initial state before the first); max_loops caps the depth. An
exit_threshold of 0 never exits early (fixed depth).

Cost per loop: two norms over each decode row's state, and one [hidden] float32 vector per
slot kept between loops; the initial state is drawn again for rows at their first loop.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_rlt.config import ExitConfig
from vllm_rlt.exit.policy import ExitDecision, ExitInputs, ExitPolicy


class LatentDiffPolicy(ExitPolicy):
    """Exit after loop r when r = max_loops, or r >= min_loops and the relative change of
    the state since the previous check is below the row's threshold."""

    fresh = {"reference": 0.0}
    needs_seeds = True

    def __init__(self, width: int, initial_state) -> None:
        self.widths = {"reference": width}
        # (seeds [rows], positions [rows]) -> [rows, width]: a row's state before loop 1
        self.initial_state = initial_state

    @classmethod
    def from_config(cls, config: ExitConfig, model: Any) -> LatentDiffPolicy:
        return cls(model.config.hidden_size, model.initial_state)

    def decide(self, x: ExitInputs) -> ExitDecision:
        state = x.hidden.float()
        first = (x.loops_done == 1).unsqueeze(1)
        reference = torch.where(
            first, self.initial_state(x.seeds, x.positions).float(), x.carried["reference"]
        )
        change = (state - reference).norm(dim=-1) / state.norm(dim=-1)
        checked = x.loops_done >= x.min_loops
        leave = (checked & (change < x.exit_threshold)) | (x.loops_done >= x.max_loops)
        reference = torch.where(checked.unsqueeze(1), state, reference)
        return ExitDecision(leave, {"reference": reference})
