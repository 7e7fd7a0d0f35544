"""`--data-parallel-size N`: N engine cores, one per GPU, behind one frontend.

Each core is a whole engine in its own process (the model's weights, its KV cache, its
scheduler) on one GPU, reached through its own `EngineCoreClient`. The frontend places
every request on the core with the least load: the fewest sequences waiting beyond its
slots, then the lowest KV-cache use it last reported, then the fewest sequences. A request
stays on its core, and its aborts follow it. A core that dies fails only its own requests
(`on_core_lost`); the others finish, and new requests go to the cores still running. Only
when every core is gone does the frontend stop (`on_death`).

Cores may also run on other hosts (`serve --headless`): they connect to this frontend over
an encrypted channel keyed by the API key (`remote_channel.py`), and count as the ranks
after the local ones.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import msgspec

from vllm_rlt.config import require
from vllm_rlt.engine.core_outputs import CoreStats, sum_core_stats
from vllm_rlt.engine.process.core_client import CoreAttachment, EngineCoreClient
from vllm_rlt.engine.process.messages import (
    AbortAll,
    AbortRequest,
    AddRequest,
    Command,
    EngineOutputs,
)
from vllm_rlt.engine.process.remote_channel import ChannelKeys, remote_peer
from vllm_rlt.engine_config import EngineConfig


@dataclass(frozen=True)
class RemoteCores:
    """Ranks from `local_size` on run on other hosts (`serve --headless`) and connect to
    this frontend at `address`, ports from `rpc_port` on, over the encrypted channel."""

    local_size: int
    address: str
    rpc_port: int
    keys: ChannelKeys


def core_environments(device: str, size: int, gpus_per_core: int = 1) -> list[dict[str, str]]:
    """The environment of each core's process: on CUDA, its own visible GPUs (one, or one
    per tensor-parallel rank), taken in order."""
    if not device.startswith("cuda"):
        return [{} for _ in range(size)]
    require(
        device == "cuda",
        f"data parallelism gives each core its own GPUs: use device 'cuda', not {device!r} "
        "(choose the GPUs with CUDA_VISIBLE_DEVICES)",
        "device",
    )
    visible = visible_gpus()
    needed = size * gpus_per_core
    require(
        needed <= len(visible),
        f"data_parallel_size {size}"
        + (f" x tensor_parallel_size {gpus_per_core}" if gpus_per_core > 1 else "")
        + f" needs {needed} GPUs, but {len(visible)} "
        + f"{'is' if len(visible) == 1 else 'are'} visible",
        "data_parallel_size",
    )
    return [
        {
            "CUDA_VISIBLE_DEVICES": ",".join(
                visible[rank * gpus_per_core : (rank + 1) * gpus_per_core]
            )
        }
        for rank in range(size)
    ]


def engine_environments(config: EngineConfig, size: int) -> list[dict[str, str]]:
    """`core_environments` for `size` cores of this engine: its device, and one GPU per
    tensor-parallel rank of each core."""
    return core_environments(
        config.device_config.device, size, config.parallel_config.tensor_parallel_size
    )


def visible_gpus() -> list[str]:
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [gpu.strip() for gpu in listed.split(",") if gpu.strip()]
    import torch  # only counts devices (NVML): no CUDA context in the frontend

    return [str(index) for index in range(torch.cuda.device_count())]


class DataParallelClient:
    """The `EngineCoreClient` interface over several cores, for `AsyncLLM`.

    Commands and reads happen on the frontend's event loop; `on_death(reason)` (every core
    is gone) and `on_core_lost(rank, reason)` (one is, others run) may run on any thread.
    """

    def __init__(
        self,
        config: EngineConfig,
        on_death: Callable[[str], None],
        in_process: bool = False,
        remote: RemoteCores | None = None,
        api_servers: int = 0,
        on_core_lost: Callable[[int, str], None] | None = None,
        envs: list[dict[str, str]] | None = None,
    ) -> None:
        """One core per `config.parallel_config.engine_cores`; `envs`: each local core's
        environment (default: `engine_environments`)."""
        size = config.parallel_config.engine_cores
        local = size if remote is None else remote.local_size
        require(
            not (api_servers and local < size),
            "several API servers need every data-parallel core on this host",
            "api_server_count",
        )
        if envs is None:
            envs = engine_environments(config, local) if local else []
        self._prepare(on_death, on_core_lost)
        try:
            for rank in range(size):
                died = partial(self._core_died, rank)
                if rank < local:
                    core = EngineCoreClient(config, died, in_process, api_servers, env=envs[rank])
                else:
                    assert remote is not None
                    peer = remote_peer(remote.address, remote.rpc_port, rank)
                    core = EngineCoreClient.remote(peer, remote.keys, died, rank)
                self.cores.append(core)
        except BaseException:
            self.shutdown()
            raise
        self._adopt(client=0)

    @classmethod
    def attach(
        cls,
        attachments: list[CoreAttachment],
        on_death: Callable[[str], None],
        on_core_lost: Callable[[int, str], None] | None = None,
    ) -> DataParallelClient:
        """Join cores another process started (one attachment per rank), as one of several
        API servers. Each server routes its own requests; the cores' KV use, which every
        message reports, reflects all of them."""
        self = cls.__new__(cls)
        self._prepare(on_death, on_core_lost)
        try:
            for rank, attachment in enumerate(attachments):
                self.cores.append(
                    EngineCoreClient.attach(attachment, partial(self._core_died, rank))
                )
        except BaseException:
            self.shutdown()
            raise
        self._adopt(client=attachments[0].client)
        return self

    def _prepare(
        self, on_death: Callable[[str], None], on_core_lost: Callable[[int, str], None] | None
    ) -> None:
        self.on_death = on_death
        self.on_core_lost = on_core_lost
        self.dead_reason: str | None = None  # every core is gone
        self.lost: dict[int, str] = {}  # rank -> why that core is gone
        self._death_lock = threading.Lock()
        self._sleep_lock = threading.Lock()  # one all-or-nothing sleep at a time
        self.cores: list[EngineCoreClient] = []

    def _adopt(self, client: int) -> None:
        """State over the connected cores; `client` is this frontend's number at each."""
        size = len(self.cores)
        infos = [core.info for core in self.cores]
        # What one request may use is bounded by the smallest core; slots add up.
        self.info = msgspec.structs.replace(
            infos[0],
            num_blocks=min(info.num_blocks for info in infos),
            max_num_seqs=sum(info.max_num_seqs for info in infos),
        )
        self.client = client
        self.process = None  # several: see `processes`
        self._owner: dict[str, tuple[int, int]] = {}  # request id -> (rank, sequences)
        self._sequences = [0] * size  # per core: sequences of unfinished requests
        self._kv_usage = [0.0] * size  # per core: as of its latest step
        self._heard = [time.monotonic()] * size  # per core: its latest message, or work

    def attachments_of(self, server: int) -> list[CoreAttachment]:
        """What API server `server` (0-based) joins every core with."""
        return [core.attachments[server] for core in self.cores]

    @property
    def size(self) -> int:
        return len(self.cores)

    @property
    def live_ranks(self) -> list[int]:
        """The cores not lost."""
        return [rank for rank in range(self.size) if rank not in self.lost]

    @property
    def processes(self) -> list[Any]:
        return [core.process for core in self.cores if core.process is not None]

    # ----------------------------------------------------------------- routing
    def choose(self, sequences: int, ranks: list[int] | None = None) -> int:
        """The core among `ranks` (default: every running one) a new request of
        `sequences` completions goes to."""

        def load(rank: int) -> tuple[int, float, int]:
            slots = self.cores[rank].info.max_num_seqs
            waiting = max(0, self._sequences[rank] + sequences - slots)
            return waiting, self._kv_usage[rank], self._sequences[rank]

        return min(ranks or self.live_ranks, key=lambda rank: (*load(rank), rank))

    def _assign(self, request_id: str, rank: int, sequences: int) -> None:
        """Count `request_id`'s `sequences` completions on core `rank` from now on."""
        if self._sequences[rank] == 0:  # an idle core owes no message until now
            self._heard[rank] = time.monotonic()
        self._owner[request_id] = (rank, sequences)
        self._sequences[rank] += sequences

    def _place(self, command: AddRequest) -> None:
        """Send a new request to the least-loaded core. A core whose death this very send
        reveals hands it on to the next; with none left, its stream fails with the rest."""
        n = command.params.n
        rank = self.choose(n)
        self._assign(command.request_id, rank, n)
        while not self.cores[rank].send(command) and rank in self.lost and self.live_ranks:
            del self._owner[command.request_id]
            self._sequences[rank] -= n
            rank = self.choose(n)
            self._assign(command.request_id, rank, n)

    def send(self, command: Command) -> None:
        if isinstance(command, AddRequest):
            owner = self._owner.get(command.request_id)
            if owner is not None:  # still running there: that core refuses it, as one would
                self.cores[owner[0]].send(command)
                return
            self._place(command)
        elif isinstance(command, AbortRequest):
            owner = self._owner.get(command.request_id)
            targets = self.cores if owner is None else [self.cores[owner[0]]]
            for core in targets:
                core.send(command)  # a lost core drops it
        elif isinstance(command, AbortAll):
            for core in self.cores:
                core.send(AbortAll(core.client))
        else:
            for core in self.cores:
                core.send(command)

    def forget_core(self, rank: int) -> list[str]:
        """The ids of the requests a lost core held, no longer counted anywhere (call it on
        the event loop, after `on_core_lost`)."""
        gone = [rid for rid, (owner, _) in self._owner.items() if owner == rank]
        for request_id in gone:
            del self._owner[request_id]
        self._sequences[rank] = 0
        return gone

    def holds(self, request_id: str) -> bool:
        """Whether a core still counts the id as its request."""
        return request_id in self._owner

    def stalled(self, timeout: float, busy: bool) -> str | None:
        """Names a core with work that has sent nothing for `timeout` seconds (a busy core
        reports at least every heartbeat), or None; each core's work is counted here, so
        the frontend's `busy` is not needed."""
        now = time.monotonic()
        for rank in self.live_ranks:
            if self._sequences[rank] > 0 and now - self._heard[rank] > timeout:
                return f"engine core {rank} made no progress for {timeout:g} s"
        return None

    # ----------------------------------------------------------------- outputs
    def start_reading(self, on_outputs: Callable[[EngineOutputs], None]) -> None:
        for rank, core in enumerate(self.cores):
            core.start_reading(partial(self._outputs, rank, on_outputs))

    def _outputs(self, rank: int, on_outputs, outputs: EngineOutputs) -> None:
        stats = outputs.stats
        self._heard[rank] = time.monotonic()
        self._kv_usage[rank] = 1.0 - stats.num_free_blocks / max(stats.num_blocks, 1)
        for delta in outputs.requests:
            if delta.finished:
                owner = self._owner.get(delta.request_id)
                if owner is not None and owner[0] == rank:
                    del self._owner[delta.request_id]
                    self._sequences[rank] -= owner[1]
        on_outputs(outputs)

    # ----------------------------------------------------------------- control
    def call(self, name: str, timeout: float = 30.0) -> CoreStats | dict[str, bool | str]:
        """Ask every running core; "stats" answers their sum, with each core's own in
        `per_core` (a lost core's as None); any other call answers yes where every core
        does, or every core's refusal. Sleep is all or nothing: when one core refuses, the
        cores this call put to sleep are woken again before the refusal is answered."""
        if name.startswith("sleep_"):
            with self._sleep_lock:
                return self._sleep_all(name, timeout)
        return self._ask_all(name, timeout)

    def _sleep_all(self, name: str, timeout: float) -> dict[str, bool | str]:
        ranks = self.live_ranks
        awake = [r for r in ranks if not self.cores[r].call("is_sleeping", timeout)["is_sleeping"]]
        answer = self._ask_all(name, timeout)
        if "error" in answer:
            for rank in awake:
                if self.cores[rank].call("is_sleeping", timeout)["is_sleeping"]:
                    woken = self.cores[rank].call("wake_up", timeout)
                    if "error" in woken:  # said, so that nobody believes the cores agree
                        answer["error"] += f"; engine core {rank} stays asleep: {woken['error']}"
        return answer  # type: ignore[return-value]

    def _ask_all(self, name: str, timeout: float) -> CoreStats | dict[str, bool | str]:
        answers = {rank: self.cores[rank].call(name, timeout) for rank in self.live_ranks}
        if name != "stats":  # every core's yes, or each refusal with its core
            errors = [f"engine core {r}: {a['error']}" for r, a in answers.items() if "error" in a]
            if errors:
                return {"error": "; ".join(errors)}
            merged: dict[str, bool | str] = {}
            for answer in answers.values():
                for key, value in answer.items():  # type: ignore[union-attr]
                    merged[key] = bool(merged.get(key, True) and value)
            return merged
        total = sum_core_stats(list(answers.values()))  # type: ignore[arg-type]
        total.per_core = [answers.get(rank) for rank in range(self.size)]  # type: ignore[misc]
        return total

    def lost_reason(self) -> str | None:
        """Which cores are gone and why, or None while all of them run."""
        if not self.lost:
            return None
        return "; ".join(
            f"engine core {rank} (of {self.size}): {reason}"
            for rank, reason in sorted(self.lost.items())
        )

    def _core_died(self, rank: int, reason: str) -> None:
        with self._death_lock:
            if rank in self.lost:
                return
            self.lost[rank] = reason
            every_core = len(self.lost) == self.size
            if every_core:
                self.dead_reason = self.lost_reason()
        if every_core or self.on_core_lost is None:
            for core in self.cores:  # without a frontend to serve them, nothing runs on
                core.send(AbortAll(core.client))
            self.on_death(self.dead_reason or f"engine core {rank} (of {self.size}): {reason}")
        else:
            self.on_core_lost(rank, reason)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop every core at once (each drains in its own process)."""
        threads = [
            threading.Thread(target=core.shutdown, args=(timeout,), daemon=True)
            for core in self.cores
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
