"""AttentionMetadata.single_plane: a once-per-token layer's view of the pass's rows."""

from __future__ import annotations

import torch

from vllm_rlt.ops.metadata import AttentionMetadata


def _meta(planes: int = 4) -> AttentionMetadata:
    rows = 3
    return AttentionMetadata(
        positions=torch.tensor([5, 7, 3]),
        row_tables=torch.tensor([0, 1, 2]),
        read_plane=torch.tensor([2, 3, 1]),
        write_lo=torch.tensor([2, 3, 1]),
        write_hi=torch.tensor([3, 4, 2]),
        row_entry=torch.tensor([5, 15, 19]),
        block_table=torch.arange(3 * 4).reshape(3, 4),
        planes=planes,
        slots_per_plane=64,
        block_size=4,
        dummy_entry=63,
        num_decode=rows,
    )


def test_every_row_reads_and_writes_plane_zero():
    once = _meta().single_plane()
    assert once.planes == 1
    assert once.read_plane.tolist() == [0, 0, 0]
    assert once.write_lo.tolist() == [0, 0, 0] and once.write_hi.tolist() == [1, 1, 1]
    assert once.positions.tolist() == [5, 7, 3]
    assert once.write_index().tolist() == [[5, 15, 19]]


def test_rows_that_do_not_write_attend_to_their_first_key_only():
    """Their output is dropped, so a decode kernel reads one block for them."""
    once = _meta().single_plane(writes=torch.tensor([True, False, True]))
    assert once.positions.tolist() == [5, 0, 3]
    assert once.positions.dtype == torch.int64
    assert once.writing.tolist() == [True, False, True]
    assert once.write_index().tolist() == [[5, 63, 19]]
