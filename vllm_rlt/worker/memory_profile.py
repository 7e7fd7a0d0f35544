"""Measure the device memory one maximum-size pass needs, to size the KV cache around it."""

from __future__ import annotations

import torch

from vllm_rlt.layers.sampler import sample, token_logprobs
from vllm_rlt.ops.metadata import AttentionMetadata, Segments
from vllm_rlt.sampling_params import MAX_LOGPROBS


def _profile_metadata(rows: int, planes: int, block_size: int, device) -> AttentionMetadata:
    """Every row at position 0 of a one-block cache: full-size activations, no real KV."""
    zeros = torch.zeros(rows, dtype=torch.int64, device=device)
    return AttentionMetadata(
        positions=zeros,
        row_tables=zeros,
        read_plane=zeros,
        write_lo=zeros,
        write_hi=torch.full_like(zeros, planes),
        row_entry=zeros,
        block_table=torch.zeros(1, 1, dtype=torch.int64, device=device),
        planes=planes,
        slots_per_plane=block_size,
        block_size=block_size,
        dummy_entry=0,
        segments=Segments(
            rows=torch.arange(rows, device=device).unsqueeze(1),
            q_pos=zeros.unsqueeze(1),
            kv_index=zeros.unsqueeze(1),
            kv_pos=zeros.unsqueeze(1),
        ),
    )


@torch.inference_mode()
def peak_pass_bytes(
    model, ops, rows: int, samplers: int, planes: int, block_size: int, kv_dtype: torch.dtype
) -> int:
    """Extra bytes allocated at peak by a pass of `rows` rows sampling `samplers` of them,
    over a K/V cache of `kv_dtype`."""
    cfg, device = model.config, model.device
    caches = [
        torch.zeros(
            planes * block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            dtype=kv_dtype,
            device=device,
        )
        for _ in range(2 * cfg.num_hidden_layers)
    ]
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    meta = _profile_metadata(rows, planes, block_size, device)
    tokens = torch.zeros(rows, dtype=torch.int64, device=device)
    hidden = model.core(
        model.prelude(tokens),
        meta,
        caches[: cfg.num_hidden_layers],
        caches[cfg.num_hidden_layers :],
        ops,
    )
    gate = model.gate(hidden)
    logits = model.coda(hidden[:samplers])
    ones = torch.ones(samplers, device=device)
    ids = sample(
        logits, ones, tokens[:samplers], ones, 0 * ones, tokens[:samplers], tokens[:samplers]
    )
    token_logprobs(logits, ids, MAX_LOGPROBS)
    del hidden, gate, logits, ids
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del caches
    torch.cuda.empty_cache()
    return peak
