"""Scheduler settings sized to the device the engine runs on, for its entry point.

A pass should carry as many rows as keep the device busy: on the CPU a pass's cost grows
with its rows from the first one, so small passes keep latency low; a large GPU runs a
pass of thousands of rows in little more time than one of a hundred, so every request that
can run should, and a burst of prompts should prefill together. Offline batches (`LLM`)
and a server are sized apart, from sweeps of each (on an H200 both found the same best
point). `docs/scheduler-defaults.md` has the table and the reasoning behind it.
Every value is a default only: a field set in SchedulerConfig (or its flag) is kept.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from vllm_rlt.config import OFFLINE, SERVE, USAGE_CONTEXTS, SchedulerConfig

logger = logging.getLogger(__name__)
LARGE_GPU_GIB = 70  # the H100/H200 class, as vLLM draws the line


@dataclass(frozen=True)
class SchedulerDefaults:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_prefill_batches_before_decode: int
    admission_scan_limit: int


# (device class, entry point) -> defaults. The large-GPU rows are the best points of
# `vllm-rlt bench sweep` on an H200, offline and served (docs/benchmarks/
# 2026-12-02-scheduler-defaults.md, 2026-12-02-serve-defaults.md); the smaller GPU's are
# vLLM's sizes for GPUs under 70 GB, not measured here. A large GPU's server scans 256
# waiting requests per pass (the default count of prompt chunks that may start in one):
# a burst reaches the core over tens of ms while passes run, and what arrived is admitted
# together (2026-12-03-burst-admission.md); an offline batch, all there at once, does
# better admitted in cohorts of 64 that start decoding while later cohorts run their
# prompts' loops.
DEFAULTS = {
    ("cpu", OFFLINE): SchedulerDefaults(64, 2048, 4, 64),
    ("cpu", SERVE): SchedulerDefaults(64, 2048, 4, 64),
    ("gpu", OFFLINE): SchedulerDefaults(256, 8192, 64, 64),
    ("gpu", SERVE): SchedulerDefaults(256, 2048, 64, 64),
    ("large gpu", OFFLINE): SchedulerDefaults(1024, 16384, 256, 64),
    ("large gpu", SERVE): SchedulerDefaults(1024, 16384, 256, 256),
}


def device_class(device: torch.device) -> tuple[str, str]:
    """("cpu" | "gpu" | "large gpu", the device as measured to decide it)."""
    if device.type != "cuda":
        return "cpu", "the CPU"
    props = torch.cuda.get_device_properties(device)
    gib = props.total_memory / 2**30
    kind = "large gpu" if gib >= LARGE_GPU_GIB else "gpu"
    size = "at least" if kind == "large gpu" else "under"
    return kind, (
        f"{props.name} ({gib:.0f} GiB, {props.multi_processor_count} SMs: {size} "
        f"{LARGE_GPU_GIB} GiB)"
    )


def size_scheduler(
    config: SchedulerConfig, device: torch.device, usage_context: str = OFFLINE
) -> tuple[SchedulerConfig, str]:
    """`config` with its unset fields taken from the device's defaults, and one line saying
    what was chosen and why (logged here; a server logs it too)."""
    if usage_context not in USAGE_CONTEXTS:
        raise ValueError(
            f"usage_context must be one of {', '.join(USAGE_CONTEXTS)}, got {usage_context!r}"
        )
    if config.is_sized and config.admission_scan_limit is not None:
        return config, "scheduler set by its flags"
    kind, measured = device_class(device)
    defaults = DEFAULTS[(kind, usage_context)]
    chosen = {
        name: getattr(defaults, name)
        for name in (f.name for f in dataclasses.fields(SchedulerDefaults))
        if getattr(config, name) is None
    }
    # an explicit max_num_seqs above the default's batched tokens still gets a row each
    if "max_num_batched_tokens" in chosen and config.max_num_seqs is not None:
        chosen["max_num_batched_tokens"] = max(
            chosen["max_num_batched_tokens"], config.max_num_seqs
        )
    if "max_num_seqs" in chosen and config.max_num_batched_tokens is not None:
        chosen["max_num_seqs"] = min(chosen["max_num_seqs"], config.max_num_batched_tokens)
    settings = ", ".join(f"{name}={value}" for name, value in chosen.items())
    note = f"scheduler sized for {measured}, {usage_context} use: {settings} (flags override)"
    logger.info(note)
    return dataclasses.replace(config, **chosen), note
