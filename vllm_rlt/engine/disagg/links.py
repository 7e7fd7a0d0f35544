"""One engine core's ends of the K/V transport between prefill and decode cores
(engine/disagg/connector.py): its own pool, shared with decode cores once, and the prefill
cores' pools it has opened. Under tensor parallelism every rank keeps its own: rank r of a
decode core reads rank r of a prefill core, whose heads are the same (both pools split the
model alike), so a core's pool travels as one handle per rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vllm_rlt.engine.disagg.connector import KVConnector, PoolHandle, SharedKV
from vllm_rlt.engine.disagg.registry import connector_class, connector_of
from vllm_rlt.worker.kv_pool import KVPool, MappedPeer, PeerKVPool


class OpenedPools:
    """The prefill cores' pools this process has opened, by pool id (each is opened once),
    each through the connector its handle names; `local` is this core's own pool, which a
    connector may read into."""

    def __init__(self, local: Callable[[], KVPool] | None = None) -> None:
        self.local = local
        self.connectors: dict[type[KVConnector], KVConnector] = {}
        self.pools: dict[str, tuple[KVConnector, PeerKVPool]] = {}

    def open(self, handle: PoolHandle) -> PeerKVPool:
        opened = self.pools.get(handle.pool_id)
        if opened is None:
            kind = connector_of(handle)
            connector = self.connectors.setdefault(kind, kind())
            opened = connector, connector.open(handle, self._local)
            self.pools[handle.pool_id] = opened
        return opened[1]

    def _local(self) -> KVPool:
        if self.local is None:
            raise ValueError("this connector reads into an engine's own pool")
        return self.local()

    def forget(self, pool_id: str) -> None:
        """Let go of a lost prefill core's pool."""
        opened = self.pools.pop(pool_id, None)
        if opened is not None:
            opened[0].forget(opened[1])

    def probe(self, handle: PoolHandle, device: torch.device) -> None:
        """Read something of an opened pool: what fails here would fail every import."""
        connector, peer = self.pools[handle.pool_id]
        connector.probe(peer, device)

    @property
    def holds_local_pool(self) -> bool:
        return any(connector.holds_local_pool for connector in self.connectors.values())


class KVLinks:
    """This rank's shared pool (once `share` has run) and opened peers."""

    def __init__(self, local: Callable[[], KVPool], rank: int) -> None:
        self.local = local
        self.rank = rank
        self.shared: SharedKV | None = None
        self.opened = OpenedPools(local)

    def share(self, connector: str) -> PoolHandle:
        """This rank's pool as decode cores read it, through `connector` (the first call
        decides it)."""
        if self.shared is None:
            self.shared = connector_class(connector)().share(self.local())
        return self.shared.handle

    def source(self, pools: Any) -> Any:
        """What this rank reads a handover from: a core's pool as one handle per rank
        (opened here once), or a pool already at hand (one process holding both cores):
        another core's `KVPool`, mapped here already, or a peer opened before."""
        if isinstance(pools, list):
            return self.opened.open(pools[self.rank])
        if isinstance(pools, KVPool):
            return MappedPeer(pools, self.local)
        return pools

    def probe(self, pools: list[PoolHandle], device: torch.device) -> None:
        """Open a core's pool (a handle per rank) and read something of it now."""
        handle = pools[self.rank]
        self.opened.open(handle)
        self.opened.probe(handle, device)

    def close(self) -> None:
        if self.shared is not None:
            self.shared.close()
