"""Per-pass attention metadata: where each row writes its K/V and which keys it reads."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# A padding key sits beyond every real position so no real query reads it; padding queries sit
# just below it so they always see at least one key and stay finite.
PAD_KEY_POSITION = 2**30
PAD_QUERY_POSITION = 2**30 - 1


@dataclass
class AttentionMetadata:
    """Rows of one pass grouped into segments that share a context (one request, one plane).

    The KV cache of a layer is a flat array of `planes * slots_per_plane` entries, so one flat
    index names both the plane and the token slot. A row writes its K/V into one entry per
    plane (the dummy entry where it does not write that plane) and reads its segment's keys.
    """

    positions: torch.Tensor  # [rows] absolute token position of each row
    write_index: torch.Tensor  # [planes, rows] flat cache index written by each row per plane
    seg_rows: torch.Tensor  # [segs, max_q] row of each query; `rows` marks padding
    seg_q_pos: torch.Tensor  # [segs, max_q] query positions; PAD_QUERY_POSITION for padding
    seg_kv_index: torch.Tensor  # [segs, max_kv] flat cache index of each key
    seg_kv_pos: torch.Tensor  # [segs, max_kv] key positions; PAD_KEY_POSITION for padding

    @property
    def num_rows(self) -> int:
        return self.positions.shape[0]
