"""The `trace` policy: replay recorded exit depths, per request (ExitConfig's
`depths_by_request`: the prefill depth first, then one per decode input). The request
checks have made sure that every admitted request has depths within its loop bounds."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from vllm_rlt.config import ExitConfig
from vllm_rlt.core.contract import NewSlot
from vllm_rlt.exit.policy import ExitDecision, ExitInputs, ExitPolicy, Upload


class TracePolicy(ExitPolicy):
    """Each slot holds its request's decode depths; a row exits at the depth of the token
    it decodes (or at max_loops)."""

    def __init__(self, depths_by_request: Mapping[str, tuple[int, ...]]) -> None:
        self.depths_by_request = depths_by_request
        self.width = max((len(d) - 1 for d in depths_by_request.values()), default=1) or 1
        self.depths = torch.ones(1, self.width, dtype=torch.int64)  # [slots, decode tokens]

    @classmethod
    def from_config(cls, config: ExitConfig, model: Any) -> TracePolicy:
        return cls(config.depths_by_request)

    def bind(self, num_slots: int, device: torch.device) -> None:
        super().bind(num_slots, device)
        self.depths = torch.ones(num_slots, self.width, dtype=torch.int64, device=device)

    def decode_depths(self, request_id: str) -> tuple[int, ...]:
        """A request's depths after the prefill one; a completion of an n > 1 request
        (`id#i`, engine/request_group.py) replays its request's."""
        depths = self.depths_by_request.get(request_id)
        if depths is None:
            depths = self.depths_by_request.get(request_id.rpartition("#")[0], ())
        return depths[1:]

    def admit(self, news: Sequence[NewSlot], slots: torch.Tensor, send: Upload) -> None:
        """One upload of (slot, token index, depth) triples for every admitted request."""
        traced = [
            (new.slot, index, depth)
            for new in news
            for index, depth in enumerate(self.decode_depths(new.request_id))
        ]
        if traced:
            triples = send(torch.tensor(traced, dtype=torch.int64).T.flatten())
            slots, columns, depths = triples.view(3, -1)
            self.depths[slots, columns] = depths

    def decide(self, x: ExitInputs) -> ExitDecision:
        index = (x.num_generated - 1).clamp(0, self.width - 1)
        target = self.depths[x.slots, index]
        leave = (x.loops_done >= target) | (x.loops_done >= x.max_loops)
        return ExitDecision(leave, {})
