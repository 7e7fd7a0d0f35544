"""Admission writes each setting of a request's SamplingRecord into the column of its name."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from vllm_rlt.core.contract import NewSlot, SamplingRecord
from vllm_rlt.layers.sampler import SamplingTensors
from vllm_rlt.worker.slot_state import SlotState


def _record(offset: int) -> SamplingRecord:
    """A record whose every numeric setting differs from every other one's."""
    return SamplingRecord(
        min_loops=1 + offset,
        max_loops=3 + offset,
        exit_threshold=0.25 + offset / 100,
        temperature=0.5 + offset / 10,
        top_k=7 + offset,
        top_p=0.75 + offset / 100,
        min_p=0.125 + offset / 100,
        top_n_sigma=1.5 + offset,
        seed=2**40 + offset,
        min_tokens=5 + offset,
        num_logprobs=0,
        banned_until_min_tokens=(),
    )


def _state() -> SlotState:
    return SlotState(
        max_slots=4,
        hidden_size=8,
        vocab_size=16,
        max_blocks_per_seq=2,
        dummy_block=0,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )


def test_admit_writes_every_setting_into_the_column_of_its_name():
    state = _state()
    records = {1: _record(0), 3: _record(2)}
    state.admit(
        [
            NewSlot(slot=slot, request_id=f"r{slot}", prompt_len=10 + slot, sampling=r)
            for slot, r in records.items()
        ]
    )
    columns = state.request_columns()
    assert set(columns) <= {f.name for f in fields(SamplingRecord)}
    for slot, record in records.items():
        for name, column in columns.items():
            assert float(column[slot]) == pytest.approx(getattr(record, name), rel=1e-6), name
        assert int(state.position[slot]) == 10 + slot
    assert float(state.sampling.temperature[2]) == 0.0  # untouched slots keep neutral values


def test_every_sampling_column_is_a_record_field_the_slot_state_writes():
    """A sampling column without a SamplingRecord field of its name would never be set."""
    record_fields = {f.name for f in fields(SamplingRecord)}
    sampling_columns = {f.name for f in fields(SamplingTensors)}
    assert sampling_columns <= record_fields
    assert sampling_columns <= set(_state().request_columns())


def test_rows_gathers_every_column():
    settings = SamplingTensors.filled(3, temperature=torch.tensor([0.0, 1.0, 2.0]), top_k=4)
    picked = settings.rows(torch.tensor([2, 0]))
    assert picked.temperature.tolist() == [2.0, 0.0]
    assert picked.top_k.tolist() == [4, 4]
    with pytest.raises(TypeError, match="no column 'temprature'"):
        SamplingTensors.filled(1, temprature=1.0)
