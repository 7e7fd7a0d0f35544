"""`serve --disaggregate P:D`: P prefill cores and D decode cores behind one frontend.

A new request goes to the least-loaded prefill core, which runs its prompt and samples
its first tokens (the stream gets them from there), then offers it (`KVOffer`): the K/V
stays in the prefill core's blocks, and only their ids and a handle to its pool travel
(engine/disagg/torch_connector.py). The frontend passes the offer to the least-loaded decode core
(`ImportRequest`), which copies the blocks into its own pool, continues the request, and
says once its copy is done; the frontend then tells the prefill core to free them
(`ReleaseHandover`). A prompt run in several chunks has its finished blocks lent early
(`KVPrefetch`): the frontend chooses the request's decode core at the first of them and
passes each on (`PrefetchKV`), that core copies them into its prefix cache while later
chunks run, and the import then copies only the rest. Aborts follow the request: to its
prefill core, and once offered to its decode core (an abort that reached the prefill
core after its offer left is sent on with the import). A decode core that dies fails its
requests; the blocks lent to it are freed. On the CPU a prefill core's pool lives in a
file that goes with the last process mapping it (or, without /proc, that the frontend
removes when that core is lost).
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Callable

import msgspec

from vllm_rlt.config import ParamError, require
from vllm_rlt.engine.disagg.registry import KVPoolHandle, connector_class
from vllm_rlt.engine.disagg.torch_connector import remove_files
from vllm_rlt.engine.process.dp_client import DataParallelClient, core_environments, visible_gpus
from vllm_rlt.engine.process.messages import (
    AbortAll,
    AbortRequest,
    AddRequest,
    Command,
    EngineOutputs,
    ForgetKVPool,
    ImportRequest,
    KVOffer,
    KVPrefetch,
    PrefetchKV,
    ReleaseHandover,
)
from vllm_rlt.engine_config import EngineConfig


def pool_layout(config: EngineConfig, size: int) -> tuple[list[dict[str, str]], EngineConfig]:
    """Each core's environment and the engine config they share. On CUDA every core
    gets GPUs of its own (one per tensor-parallel rank) while there are enough; with fewer,
    cores of one GPU each take the visible GPUs in turn and split each GPU's memory: each
    plans its KV cache within gpu_memory_utilization / (cores on that GPU) of it."""
    ranks = config.parallel_config.tensor_parallel_size
    device = config.device_config.device
    if not device.startswith("cuda"):
        return [{} for _ in range(size)], config
    visible = visible_gpus() if device == "cuda" else []
    require(
        device != "cuda" or bool(visible),
        "disaggregate on CUDA needs a visible GPU, but none is",
        "disaggregate",
    )
    if device != "cuda":
        return core_environments(device, size), config  # names the wrong device
    require(
        ranks == 1 or size * ranks <= len(visible),
        f"disaggregate: {size} engine cores x tensor_parallel_size {ranks} need "
        f"{size * ranks} GPUs, but {len(visible)} {'is' if len(visible) == 1 else 'are'} "
        "visible",
        "disaggregate",
    )
    pool = visible[: size * ranks]
    # Its own GPUs first (rank r on its "cuda:r"), then the pool's others: a decode core
    # opens the K/V a prefill core holds on its GPUs through CUDA IPC
    # (engine/disagg/torch_connector.py).
    owned = [
        [pool[(core * ranks + rank) % len(pool)] for rank in range(ranks)] for core in range(size)
    ]
    envs = [
        {"CUDA_VISIBLE_DEVICES": ",".join(own + [gpu for gpu in pool if gpu not in own])}
        for own in owned
    ]
    if len(visible) >= size * ranks:
        return envs, config
    cache = config.cache_config
    utilization = cache.gpu_memory_utilization / -(-size // len(pool))
    shared = dataclasses.replace(cache, gpu_memory_utilization=utilization)
    return envs, dataclasses.replace(config, cache_config=shared)


class DisaggregatedClient(DataParallelClient):
    """The `EngineCoreClient` interface over prefill cores (ranks 0..P-1) and decode cores
    (ranks P..P+D-1) of `config.parallel_config.disaggregate`, for `AsyncLLM`."""

    def __init__(
        self,
        config: EngineConfig,
        on_death: Callable[[str], None],
        in_process: bool = False,
        on_core_lost: Callable[[int, str], None] | None = None,
    ) -> None:
        parallel = config.parallel_config
        assert parallel.disaggregate is not None, "make_client starts these cores"
        prefill, decode = parallel.disaggregate
        self.num_prefill = prefill
        connector = connector_class(parallel.kv_connector)
        if (missing := connector.missing()) is not None:
            raise ParamError(f"{connector.name}: {missing}", "kv_connector")
        self.kv_connector = connector.name
        # request id -> (prefill rank whose blocks it has not yet copied, decode rank)
        self._lent_by: dict[str, tuple[int, int]] = {}
        # request id -> the decode rank its early-lent blocks go to (until its offer), and
        # [prefill rank, that decode rank, early lends not yet copied]
        self._prefetch_target: dict[str, int] = {}
        self._prefetch_lent: dict[str, list[int]] = {}
        # prefill rank -> its pool's named files (CPU without /proc; one per tensor-parallel
        # rank), to remove should that core die
        self._pool_files: dict[int, list[str]] = {}
        self._pool_ids: dict[int, list[str]] = {}  # prefill rank -> its pool's ids
        # request id -> aborts sent to its prefill core, sent on with the import
        self._early_aborts: dict[str, list[AbortRequest]] = {}
        envs, config = pool_layout(config, prefill + decode)
        super().__init__(config, on_death, in_process, on_core_lost=on_core_lost, envs=envs)
        try:
            self._check_transport()
        except BaseException:
            self.shutdown()
            raise

    def _check_transport(self) -> None:
        """Every decode core maps every prefill core's pool and reads from it now: a
        transfer that cannot work (no access to the other GPU's memory, no shared memory)
        stops the start-up with one line naming both cores, not the first request."""
        for source in range(self.num_prefill):
            shared = self._ask(
                source, f"kv_share:{self.kv_connector}", f"prefill engine core {source}"
            )
            if "error" in shared:
                raise RuntimeError(
                    f"--disaggregate: prefill engine core {source} cannot share its KV pool: "
                    f"{shared['error']}"
                )
            encoded = base64.b64decode(shared["pool"])
            pools = msgspec.msgpack.decode(encoded, type=list[KVPoolHandle])
            self._pool_ids[source] = [pool.pool_id for pool in pools]
            self._pool_files[source] = [pool.named_file for pool in pools if pool.named_file]
            for target in range(self.num_prefill, len(self.cores)):
                pair = f"decode engine core {target} and prefill engine core {source}"
                opened = self._ask(target, f"kv_open:{shared['pool']}", pair)
                if "error" in opened:
                    raise RuntimeError(
                        f"--disaggregate: decode engine core {target} cannot read the KV pool "
                        f"of prefill engine core {source}: {opened['error']}"
                    )

    def _ask(self, rank: int, call: str, who: str) -> dict:
        """A start-up call, its failure (timeout, a core that died) named by `who`."""
        try:
            return self.cores[rank].call(call, timeout=300)  # type: ignore[return-value]
        except Exception as exc:  # noqa: BLE001 - restated without the call's long argument
            raise RuntimeError(
                f"--disaggregate: the K/V transport check ({who}) failed: {type(exc).__name__}"
            ) from None

    @property
    def prefill_ranks(self) -> list[int]:
        return [rank for rank in self.live_ranks if rank < self.num_prefill]

    @property
    def decode_ranks(self) -> list[int]:
        return [rank for rank in self.live_ranks if rank >= self.num_prefill]

    def choose(self, sequences: int, ranks: list[int] | None = None) -> int:
        """The least-loaded core among `ranks` (default: the prefill cores); with every
        core of that role gone, among those still running."""
        return super().choose(sequences, self.prefill_ranks if ranks is None else ranks)

    def send(self, command: Command) -> None:
        if isinstance(command, AddRequest) and command.request_id not in self._owner:
            command = AddRequest(
                command.request_id,
                command.prompt_token_ids,
                command.params,
                command.client,
                handover=True,
            )
        elif isinstance(command, AbortRequest):
            owner = self._owner.get(command.request_id)
            if owner is not None and owner[0] < self.num_prefill:
                self._early_aborts.setdefault(command.request_id, []).append(command)
        elif isinstance(command, AbortAll):  # offers may be on their way: abort them too
            for request_id, (rank, _) in self._owner.items():
                if rank < self.num_prefill:
                    self._early_aborts.setdefault(request_id, []).append(AbortRequest(request_id))
        super().send(command)

    def _outputs(self, rank: int, on_outputs, outputs: EngineOutputs) -> None:
        for prefetch in outputs.prefetches:
            self._prefetch(rank, prefetch)
        for offer in outputs.offers:
            self._pass_on(rank, offer)
        for request_id in outputs.prefetched:  # before the imports: lends go oldest first
            lent = self._prefetch_lent.get(request_id)
            if lent is None:
                continue
            lent[2] -= 1
            if not lent[2]:
                del self._prefetch_lent[request_id]
            if lent[0] not in self.lost:
                self.cores[lent[0]].send(ReleaseHandover(request_id))
        for request_id in outputs.imported:
            source, _ = self._lent_by.pop(request_id, (None, None))
            if source is not None and source not in self.lost:
                self.cores[source].send(ReleaseHandover(request_id))
        for delta in outputs.requests:  # before the frontend sees them: it may send a new
            if delta.finished:  # request of a finished id at once (engine/held_commands.py)
                self._early_aborts.pop(delta.request_id, None)
                self._prefetch_target.pop(delta.request_id, None)
        super()._outputs(rank, on_outputs, outputs)

    def _prefetch(self, source: int, prefetch: KVPrefetch) -> None:
        """Pass early-lent prompt blocks to the request's decode core, chosen now at its
        first prefetch (with none alive, they are released at once)."""
        request_id = prefetch.request_id
        target = self._prefetch_target.get(request_id)
        if target is None or target in self.lost:
            if not self.decode_ranks:
                self.cores[source].send(ReleaseHandover(request_id))
                return
            owner = self._owner.get(request_id)
            target = self.choose(1 if owner is None else owner[1], self.decode_ranks)
            self._prefetch_target[request_id] = target
        self._prefetch_lent.setdefault(request_id, [source, target, 0])[2] += 1
        self.cores[target].send(PrefetchKV(prefetch, self.client))

    def _pass_on(self, source: int, offer: KVOffer) -> None:
        """Move an offered request to a decode core: its owner, sequences and aborts."""
        request_id = offer.request_id
        owner = self._owner.pop(request_id, None)
        sequences = offer.params.n if owner is None else owner[1]
        if owner is not None:
            self._sequences[owner[0]] -= sequences
        target = self._prefetch_target.pop(request_id, None)  # holds its early blocks
        if target is None or target in self.lost:
            target = self.choose(sequences, self.decode_ranks)
        self._assign(request_id, target, sequences)
        self._lent_by[request_id] = (source, target)
        self.cores[target].send(ImportRequest(offer, self.client))
        for abort in self._early_aborts.pop(request_id, []):
            self.cores[target].send(abort)

    def holds(self, request_id: str) -> bool:
        """Also while its blocks lent to a decode core wait for the copy's report: those
        records are kept by id, so a new request of the id must not lend before."""
        return (
            super().holds(request_id)
            or request_id in self._lent_by
            or request_id in self._prefetch_lent
        )

    def forget_core(self, rank: int) -> list[str]:
        """A lost core's requests (see DataParallelClient). The blocks lent to a lost decode
        core are freed at their prefill cores; a lost prefill core's pool file is removed,
        and the decode cores let go of that pool once their queued imports from it are done."""
        for request_id, (source, target) in list(self._lent_by.items()):
            if target == rank:  # also when its request already finished there
                del self._lent_by[request_id]
                if source not in self.lost:
                    self.cores[source].send(ReleaseHandover(request_id))
        for request_id, (source, target, count) in list(self._prefetch_lent.items()):
            if rank not in (source, target):
                continue
            del self._prefetch_lent[request_id]
            if target == rank and source not in self.lost:
                for _ in range(count):
                    self.cores[source].send(ReleaseHandover(request_id))
        remove_files(self._pool_files.pop(rank, []))
        for pool_id in self._pool_ids.pop(rank, []):
            for target in self.decode_ranks:
                if target != rank:
                    self.cores[target].send(ForgetKVPool(pool_id))
        gone = super().forget_core(rank)
        for request_id in gone:
            self._early_aborts.pop(request_id, None)
        return gone
