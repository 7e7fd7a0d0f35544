"""Tensor parallelism over torch.distributed: one model split over N processes.

Each rank holds 1/N of every layer (the model splits itself: `LoopedModel.shard`,
models/interface.py): its share of the attention heads (q, k and v rows of
those heads: column-parallel) and of the MLP's intermediate features (gate/up rows:
column-parallel), and the matching columns of o and down (row-parallel). After o and after
down, one all-reduce sums the ranks' partial products, so every rank holds the whole
residual stream. The embedding, the norms, the exit gate and the LM head are replicated:
all ranks compute them from the same all-reduced state, so they take the same exit
decisions and draw the same tokens. The KV cache of a rank holds its heads only.

Every rank runs a whole engine (scheduler included), and rank 0, the one that serves
requests, mirrors each call that changes its engine to the others before it makes it
(`TensorParallel.mirror`). Since the engines start equal and see equal inputs and equal
model outputs, they stay equal, and only rank 0's outputs are used. NCCL carries the
collectives on CUDA (CUDA graphs capture them), gloo on the CPU; the mirrored calls go
over a gloo group of their own.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import logging
import multiprocessing
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from vllm_rlt.config import require

logger = logging.getLogger(__name__)

STARTUP_POLL_S = 0.5  # how often rank 0 looks at the other ranks while they join
CONTROL_TIMEOUT = datetime.timedelta(days=365)


class TensorParallelLost(BaseException):
    """Another rank is gone: the engine cannot take another step. Like KeyboardInterrupt
    it passes the handlers that fail a single request, so the engine stops (a server
    then answers 503) instead of failing every request one by one."""


@dataclass
class TensorParallel:
    """This process's place in the group and the groups it talks through."""

    rank: int
    world: int
    device_group: Any  # collectives of the model (NCCL on CUDA, gloo on the CPU)
    control_group: Any  # mirrored engine calls, pickled (gloo)
    followers: list[Any] = dataclasses.field(default_factory=list)  # rank 0: ranks 1..N-1

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, group=self.device_group)
        return tensor

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's value (the KV blocks all of them can hold)."""
        held = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(held, op=dist.ReduceOp.MIN, group=self.control_group)
        return int(held.item())

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order (each rank calls this in the same mirrored
        call: disaggregation's transfers, whose outcome one rank alone cannot know)."""
        values: list[Any] = [None] * self.world
        dist.all_gather_object(values, value, group=self.control_group)
        return values

    def check_followers(self) -> None:
        """Rank 0: raise TensorParallelLost if another rank has exited."""
        for rank, process in enumerate(self.followers, start=1):
            if process.exitcode is not None:
                raise TensorParallelLost(
                    f"tensor-parallel rank {rank} exited with code {process.exitcode}"
                )

    def mirror(self, name: str, args: tuple, kwargs: dict) -> None:
        """Rank 0: send an engine call to the other ranks, which make it too."""
        self.check_followers()
        try:
            dist.broadcast_object_list([(name, args, kwargs)], src=0, group=self.control_group)
        except RuntimeError as exc:
            raise TensorParallelLost(f"a tensor-parallel rank is gone: {exc}") from None

    def receive(self) -> tuple[str, tuple, dict]:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control_group)
        return box[0]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def mirrored(method):
    """Marks an engine call that changes the engine: under tensor parallelism rank 0 sends
    it to the other ranks (its `mirror`) before making it, so their engines stay equal. A
    part of the engine held in one of its attributes mirrors its own calls through
    `mirror_part`."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if self.mirror is not None:
            self.mirror(method.__name__, args, kwargs)
        return method(self, *args, **kwargs)

    return call


def mirror_part(
    mirror: Callable[[str, tuple, dict], None] | None, attribute: str
) -> Callable[[str, tuple, dict], None] | None:
    """The mirror of the engine part held in the engine's `attribute`: its calls go to the
    other ranks as "attribute.name" (`follow` finds them there)."""
    if mirror is None:
        return None
    return lambda name, args, kwargs: mirror(f"{attribute}.{name}", args, kwargs)


def check_tensor_parallel(size: int, config: Any, device: torch.device) -> None:
    """Every reason a model cannot be split `size` ways here, as one clear error."""
    require(
        not dist.is_initialized(),
        "tensor_parallel_size: this process already belongs to a torch.distributed group "
        "(one tensor-parallel LLM per process)",
        "tensor_parallel_size",
    )
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(config, name)
        require(
            value % size == 0,
            f"tensor_parallel_size {size} must divide the model's {name} ({value})",
            "tensor_parallel_size",
        )
    if device.type == "cuda":
        count = torch.cuda.device_count()
        require(
            size <= count,
            f"tensor_parallel_size {size} needs {size} GPUs, but {count} "
            f"{'is' if count == 1 else 'are'} visible",
            "tensor_parallel_size",
        )
        require(
            device.index in (None, 0),
            f"with tensor parallelism rank r runs on cuda:r: use device 'cuda', not '{device}'",
            "device",
        )


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device


def join_group(
    rank: int, world: int, port: int, device: torch.device, followers: list[Any] = ()
) -> TensorParallel:
    """Join the group on loopback (blocks until every rank has). Rank 0 passes the other
    ranks' processes: one that exits before joining is an error at once, not a wait for
    the store's timeout."""
    if device.type == "cuda":  # the current device is per thread: set it here too
        torch.cuda.set_device(rank_device(device, rank))
    if followers:
        joined: dict[str, Any] = {}

        def join() -> None:
            try:
                joined["group"] = join_group(rank, world, port, device)
            except BaseException as exc:  # noqa: BLE001 - raised by the caller below
                joined["error"] = exc

        thread = threading.Thread(target=join, name="vllm-rlt-tp-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(STARTUP_POLL_S)
            for other, process in enumerate(followers, start=1):
                if process.exitcode is not None and thread.is_alive():
                    raise RuntimeError(
                        f"tensor-parallel rank {other} exited with code {process.exitcode} "
                        "while starting (its error is in the log above)"
                    )
        if "error" in joined:
            raise joined["error"]
        joined["group"].followers = list(followers)
        return joined["group"]
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    # Followers wait on this group for as long as the engine idles; a dead rank 0 ends
    # them through their parent watch and the closed connection, not through a timeout.
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return TensorParallel(rank, world, dist.group.WORLD, control)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_followers(world: int, port: int, target: Callable[..., None], config: Any) -> list[Any]:
    """Spawn ranks 1 .. world - 1, each running `target(rank, port, config, parent pid)`,
    which builds the same engine from rank 0's (picklable) engine config."""
    spawn = multiprocessing.get_context("spawn")
    processes = []
    for rank in range(1, world):
        process = spawn.Process(
            target=target,
            args=(rank, port, config, os.getpid()),
            name=f"vllm-rlt-tp-rank-{rank}",
            daemon=True,
        )
        process.start()
        processes.append(process)
    return processes


def stop_followers(tp: TensorParallel, followers: list[Any], timeout: float = 30.0) -> None:
    """Rank 0, when its engine goes: tell the other ranks to stop, and wait for them."""
    try:
        tp.mirror("stop", (), {})
    except (Exception, TensorParallelLost):  # a rank already gone: the rest are killed below
        logger.debug("stopping the other tensor-parallel ranks failed", exc_info=True)
    finally:
        tp.close()
    for process in followers:
        process.join(timeout)
        if process.is_alive():
            process.kill()


def follow(engine: Any, tp: TensorParallel) -> None:
    """A rank other than 0: make every engine call rank 0 mirrors (a dotted name: a call
    of an engine part), until it says stop."""
    while True:
        name, args, kwargs = tp.receive()
        if name == "stop":
            tp.close()
            return
        try:
            functools.reduce(getattr, name.split("."), engine)(*args, **kwargs)
        except Exception:  # noqa: BLE001 - rank 0 got the same error and reported it
            logger.debug("mirrored %s failed as on rank 0", name, exc_info=True)
