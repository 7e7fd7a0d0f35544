"""Weights from a trainer in another process, as SGLang names the calls: the engine core
joins the trainer's torch.distributed group (`init_weights_update_group`) and takes each
tensor the trainer broadcasts (`update_weights_from_distributed`); the trainer's side of
the same group (`trainer_group`, `send_weights`); a checkpoint read from disk; and the
core loop's side of these calls and of pause mode "keep" (`CoreRL`).

The group is built apart from torch.distributed's default group (which tensor parallelism
may hold): a TCPStore that the trainer (rank 0) serves, a PrefixStore of the group's name,
and a gloo (CPU) or NCCL (CUDA) process group object made directly on them.
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import weakref
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vllm_rlt.config import ParamError, require, require_int
from vllm_rlt.engine.trainer_hooks import copy_weights_in_place
from vllm_rlt.layers.fp8 import Fp8Weight

logger = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
WEIGHT_CALLS = (
    "init_weights_update_group",
    "update_weights_from_distributed",
    "update_weights_from_disk",
)
JOIN_STATUS = "join_status"  # how the join that init_weights_update_group started goes
DEFAULT_GROUP_NAME = "weight_update_group"
GROUP_TIMEOUT = datetime.timedelta(minutes=10)
MAX_WORLD_SIZE = 65536


def default_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


class WeightGroup:
    """One member of a trainer's weight-update group: rank 0 is the trainer, which serves
    the store at `master_address:master_port`; every rank blocks here until all joined."""

    def __init__(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        group_name: str = DEFAULT_GROUP_NAME,
        backend: str = "gloo",
        device: torch.device | str = "cpu",
        timeout: datetime.timedelta = GROUP_TIMEOUT,
    ) -> None:
        require(
            isinstance(master_address, str) and bool(master_address),
            "master_address must be a host name or address",
            "master_address",
        )
        require_int(master_port, "master_port", 1, 65535)
        require_int(world_size, "world_size", 2, MAX_WORLD_SIZE)
        require_int(rank, "rank_offset", 0, world_size - 1)
        require(
            isinstance(group_name, str) and bool(group_name),
            "group_name must be a non-empty string",
            "group_name",
        )
        require(
            backend in BACKENDS,
            f"backend must be one of {list(BACKENDS)}, got {backend!r}",
            "backend",
        )
        self.device = torch.device(device)
        require(
            backend == "gloo" or (self.device.type == "cuda" and dist.is_nccl_available()),
            "backend 'nccl' needs CUDA tensors and a torch built with NCCL: use 'gloo' on the CPU",
            "backend",
        )
        self.rank, self.world_size = rank, world_size
        self.tensor_device = self.device if backend == "nccl" else torch.device("cpu")
        store = dist.TCPStore(
            master_address,
            master_port,
            world_size,
            is_master=rank == 0,
            timeout=timeout,
            wait_for_workers=False,
        )
        prefixed = dist.PrefixStore(group_name, store)
        if backend == "gloo":
            self.group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        self.store = store  # the trainer's store serves as long as the group lives

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0 sends `tensor`; every other rank receives into it."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.group.broadcast([tensor], options).wait()
        return tensor


def trainer_group(
    master_address: str,
    master_port: int,
    world_size: int,
    group_name: str = DEFAULT_GROUP_NAME,
    backend: str = "gloo",
    device: torch.device | str = "cpu",
) -> WeightGroup:
    """The trainer's side (rank 0): call it while the engine's `init_weights_update_group`
    runs (both block until every rank joined)."""
    return WeightGroup(master_address, master_port, 0, world_size, group_name, backend, device)


def weight_specs(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> tuple[list[str], list[str], list[list[int]]]:
    """The names, dtypes and shapes `update_weights_from_distributed` takes for `weights`."""
    pairs = list(weights)
    return (
        [name for name, _ in pairs],
        [str(tensor.dtype).removeprefix("torch.") for _, tensor in pairs],
        [list(tensor.shape) for _, tensor in pairs],
    )


def send_weights(group: WeightGroup, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """The trainer broadcasts each tensor, in the order of the names it gave the engine."""
    for _, tensor in weights:
        group.broadcast(tensor.detach().to(group.tensor_device).contiguous())


def parse_specs(names: Any, dtypes: Any, shapes: Any) -> list[tuple[str, torch.dtype, tuple]]:
    """(name, dtype, shape) of each tensor an update announces; a malformed list is a
    ValueError naming it, raised before anything is received."""
    for field, value in (("names", names), ("dtypes", dtypes), ("shapes", shapes)):
        require(isinstance(value, (list, tuple)), f"{field} must be a list", field)
    require(
        len(names) == len(dtypes) == len(shapes),
        f"names, dtypes and shapes must have one entry per tensor, got {len(names)}, "
        f"{len(dtypes)} and {len(shapes)}",
        "names",
    )
    specs = []
    for index, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes, strict=True)):
        require(isinstance(name, str), f"names[{index}] must be a string", "names")
        found = getattr(torch, str(dtype).removeprefix("torch."), None)
        require(
            isinstance(found, torch.dtype),
            f"dtypes[{index}] must name a torch dtype such as 'bfloat16', got {dtype!r}",
            "dtypes",
        )
        require(
            isinstance(shape, (list, tuple))
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape),
            f"shapes[{index}] must be a list of sizes >= 0, got {shape!r}",
            "shapes",
        )
        specs.append((name, found, tuple(shape)))
    return specs


def model_dtype(model, view) -> torch.dtype:
    """The dtype new weights for `view` must have: the model's own (an fp8 projection is
    given it and quantizes)."""
    return model.dtype if isinstance(view, Fp8Weight) else view.dtype


class WeightSync:
    """An engine core's member of a trainer's group, and the version tag of its weights."""

    def __init__(self, engine) -> None:
        # A proxy: the engine owns this object, and a cycle would keep a collected engine
        # (and its tensor-parallel group, closed when the engine goes) alive until gc runs.
        self.engine = weakref.proxy(engine)
        self.group: WeightGroup | None = None
        self.version: str | None = None

    def init_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = DEFAULT_GROUP_NAME,
        backend: str | None = None,
    ) -> None:
        """Join the trainer's group as rank `rank_offset` (the trainer is rank 0); a new
        group replaces the one joined before."""
        self._require_single_process("init_weights_update_group")
        require_int(world_size, "world_size", 2, MAX_WORLD_SIZE)
        require_int(rank_offset, "rank_offset", 1, world_size - 1)
        device = self.engine.model.device
        backend = default_backend(device) if backend is None else backend
        self.group = None
        self.group = WeightGroup(
            master_address, master_port, rank_offset, world_size, group_name, backend, device
        )

    def update_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        weight_version: str | None = None,
        paused: bool = False,
    ) -> None:
        """Receive every tensor the trainer broadcasts and copy it into the model in place.
        A wrong name, dtype or shape, or an engine that is busy or asleep, fails the update
        with nothing changed; the tensors are received all the same (into scratch, then
        dropped) so that the trainer's broadcasts do not hang. Only lists that describe no
        tensors, or no group, are refused before anything is received. `paused`: requests
        are frozen in flight (pause mode "keep") and carry on with the new weights."""
        specs = parse_specs(names, dtypes, shapes)
        require(
            weight_version is None or isinstance(weight_version, str),
            "weight_version must be a string",
            "weight_version",
        )
        group = self.group
        require(group is not None, "call init_weights_update_group first", "names")
        assert group is not None
        refusal = None
        try:
            self._require_ready("update_weights_from_distributed", paused)
            require(*self._check(specs, with_dtypes=True), "names")
        except ValueError as exc:
            refusal = exc
        copied = 0
        try:
            for name, dtype, shape in specs:
                tensor = group.broadcast(
                    torch.empty(shape, dtype=dtype, device=group.tensor_device)
                )
                if refusal is None:
                    copy_weights_in_place(self.engine.model, [(name, tensor)])
                    copied += 1
        except Exception as exc:
            if copied:  # a transport failure part way: say the weights are a mix
                self.version = None
                raise RuntimeError(
                    f"the update broke off after {copied} of {len(specs)} tensors ({exc}): "
                    "the weights are a mix, send them again"
                ) from exc
            raise
        if refusal is not None:
            raise refusal
        self._finish(weight_version)

    def update_from_disk(
        self, model_path: str, weight_version: str | None = None, paused: bool = False
    ) -> None:
        """Copy a checkpoint folder's safetensors weights into the model in place (same
        names and shapes, cast to the model's dtype; nothing changed when one is wrong)."""
        from safetensors.torch import load_file

        require(isinstance(model_path, str), "model_path must be a folder path", "model_path")
        shown = model_path if len(model_path) <= 200 else model_path[:200] + "..."
        try:
            files = sorted(Path(model_path).glob("*.safetensors"))
        except (OSError, ValueError) as exc:
            raise ParamError(f"model_path {shown!r} cannot be read: {exc}", "model_path") from exc
        require(bool(files), f"model_path {shown!r} holds no .safetensors file", "model_path")
        self._require_ready("update_weights_from_disk", paused)
        weights: dict[str, torch.Tensor] = {}
        for file in files:
            try:
                weights.update(load_file(str(file)))
            except Exception as exc:  # noqa: BLE001 - safetensors' own error types vary
                raise ParamError(
                    f"model_path: {file.name} is not a readable safetensors file "
                    f"({type(exc).__name__}: {exc})",
                    "model_path",
                ) from exc
        specs = [(name, tensor.dtype, tuple(tensor.shape)) for name, tensor in weights.items()]
        require(*self._check(specs, with_dtypes=False), "model_path")
        copy_weights_in_place(self.engine.model, weights)
        self._finish(weight_version)

    def _require_single_process(self, call: str) -> None:
        require(
            self.engine.mirror is None,
            f"{call} with tensor_parallel_size > 1 is not supported",
            "tensor_parallel_size",
        )

    def _require_ready(self, call: str, paused: bool) -> None:
        self._require_single_process(call)
        engine, hooks = self.engine, self.engine.hooks
        require(
            hooks.sleeping is None or "weights" not in hooks.sleeping.asleep,
            "the engine's weights are asleep: wake them up first (wake_up(tags=['weights']))",
            "names",
        )
        if not paused:
            engine._require_idle(call, "names")

    def _check(
        self, specs: list[tuple[str, torch.dtype, tuple]], with_dtypes: bool
    ) -> tuple[bool, str]:
        """(True, "") for an update of these tensors the model takes, else (False, why)."""
        model = self.engine.model
        views = model.checkpoint_views()
        skipped = (
            "rotary_emb.inv_freq",
            *(["lm_head.weight"] if model.config.tie_word_embeddings else []),
        )
        names = set()
        for name, dtype, shape in specs:
            if name.endswith(skipped):
                continue
            if name not in views:
                return False, f"{name!r} is no tensor of this model"
            want = tuple(views[name].shape)
            if shape != want:
                return False, f"{name} has shape {shape}, the model's is {want}"
            own = model_dtype(model, views[name])
            if with_dtypes and dtype != own:
                return False, f"{name} has dtype {dtype}, the model's is {own}"
            names.add(name)
        if self.engine.hooks.weights_unset and names != set(views):
            return False, "after sleep(level=2) an update needs every tensor of the checkpoint"
        return True, ""

    def _finish(self, weight_version: str | None) -> None:
        """The weights are in: the prefix cache's K/V came from the old ones. Without a new
        tag the previous one stays (as SGLang keeps it)."""
        self.engine.hooks.weights_unset = False
        self.engine.kv.forget_cached_prefixes()
        if weight_version is not None:
            self.version = weight_version


class CoreRL:
    """The core loop's side: whether its requests are frozen (pause mode "keep": no pass
    runs), and the weight calls, each `name:json arguments` on the control socket."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.frozen = False
        self.joining: Future | None = None  # a join of the trainer's group, under way or done

    def control(self, name: str) -> dict[str, bool | str] | None:
        """The answer to a control call of this side; None: not one of them. Joining a
        trainer's group waits for every rank, up to the group's timeout, so it runs on a
        thread of its own and the call answers at once: a trainer that is late or never
        comes (a wrong address) holds neither the core's passes nor its other calls, and
        the frontend asks JOIN_STATUS until the join ends."""
        call, _, payload = name.partition(":")
        if call in ("pause_keep", "resume"):
            self.frozen = call == "pause_keep"
            return {"paused": self.frozen}
        if call == JOIN_STATUS:
            return self._join_status()
        if call not in WEIGHT_CALLS:
            return None
        if call != "init_weights_update_group":
            return self._answer(call, payload)
        if self.joining is not None and not self.joining.done():
            return {
                "error": "a join of a trainer's group is already under way: it ends when "
                f"every rank has joined or after {GROUP_TIMEOUT.total_seconds():g} s",
                "param": "master_address",
            }
        joined: Future = Future()
        threading.Thread(
            target=lambda: joined.set_result(self._answer(call, payload)),
            name="weight-group-join",
            daemon=True,  # a core told to stop does not wait for a trainer
        ).start()
        self.joining = joined
        return {"joining": True}

    def _join_status(self) -> dict[str, bool | str]:
        """{"joining": True} while the join runs, then its answer (once)."""
        joined = self.joining
        if joined is None:
            return {"error": "no join of a trainer's group was started", "internal": True}
        if not joined.done():
            return {"joining": True}
        self.joining = None
        return joined.result()

    def _answer(self, call: str, payload: str) -> dict[str, bool | str]:
        sync = self.engine.weight_sync
        try:
            args = json.loads(payload or "{}")
            if call == "init_weights_update_group":
                sync.init_group(**args)
            elif call == "update_weights_from_distributed":
                sync.update_from_distributed(**args, paused=self.frozen)
            else:
                sync.update_from_disk(**args, paused=self.frozen)
        except ValueError as exc:
            return {"error": str(exc), "param": getattr(exc, "param", None) or ""}
        except Exception as exc:  # noqa: BLE001 - answered; the core serves on
            logger.exception("control call %s failed", call)
            return {"error": f"{call} failed: {type(exc).__name__}: {exc}", "internal": True}
        return {} if sync.version is None else {"weight_version": sync.version}
