"""`vllm-rlt serve --headless`: engine cores on this host for a frontend on another one.

Each core is the same engine-core process as under a local frontend, with one GPU, and
connects to the frontend's address over the encrypted channel keyed by the API key
(`engine/process/remote_channel.py`). This process starts them and waits: it exits 0 when every
core has stopped (the frontend shut them down), and 1 when one failed or lost its frontend
(its own log says why). SIGTERM or SIGINT stops them all.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import signal

from vllm_rlt.engine.process.core_proc import run_engine_core
from vllm_rlt.engine.process.dp_client import engine_environments
from vllm_rlt.engine.process.remote_channel import channel_keys, remote_peer
from vllm_rlt.engine_config import EngineConfig

logger = logging.getLogger("vllm_rlt.server")


def run_headless(
    config: EngineConfig,
    local_size: int,
    start_rank: int,
    address: str,
    rpc_port: int,
    api_key: str,
) -> int:
    """Run ranks start_rank .. start_rank + local_size - 1; the process's exit code."""
    envs = engine_environments(config, local_size)
    keys = channel_keys(api_key)
    spawn = multiprocessing.get_context("spawn")
    cores = {}
    for index, env in enumerate(envs):
        rank = start_rank + index
        peer = remote_peer(address, rpc_port, rank)
        process = spawn.Process(
            target=run_engine_core,
            args=(config, [peer], os.getpid(), None, env, keys),
            name=f"vllm-rlt-engine-core-{rank}",
        )
        process.start()
        cores[process.sentinel] = (rank, process)
        logger.info("engine core %d (pid %d) connects to %s", rank, process.pid, peer[0])
    stopping = False

    def stop(signum, frame) -> None:
        nonlocal stopping
        stopping = True
        for _, process in cores.values():
            process.kill()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = 0
    while cores:
        for sentinel in multiprocessing.connection.wait(list(cores)):
            rank, process = cores.pop(sentinel)
            process.join()
            if process.exitcode != 0 and not stopping:
                logger.error("engine core %d exited with code %s", rank, process.exitcode)
                code = 1
                stop(None, None)
    return code
