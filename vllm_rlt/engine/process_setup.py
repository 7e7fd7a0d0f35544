"""How a process of its own (an engine core, a tensor-parallel rank, an API server) settles
once what it serves with is built, before the first request."""

from __future__ import annotations

import gc
import logging
import os

import torch

logger = logging.getLogger(__name__)


def drive_with_one_host_thread(device: torch.device) -> None:
    """A process that drives a GPU keeps torch to one host thread unless OMP_NUM_THREADS
    says otherwise. Its host work is small tensors, and a pool of threads in every such
    process spins against the API servers and the other processes on the same CPU cores:
    on an H200 host, the engine core's default pool cut a burst of 256 served requests
    from 0.93-0.98 of the offline engine's tokens/s to 0.84."""
    if device.type == "cuda" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
        logger.debug("process on %s: one torch host thread", device)


def settle_engine_process(device: torch.device) -> None:
    """An engine core or tensor-parallel rank, its engine built: both of the above."""
    drive_with_one_host_thread(device)
    freeze_startup_heap()


def freeze_startup_heap() -> None:
    """Move every object built so far (modules, the runtime's, the app's) out of the cyclic
    collector's reach: they live as long as the process, and a full collection walking
    them pauses the process for 100 ms or more in the middle of a burst."""
    gc.collect()
    gc.freeze()
