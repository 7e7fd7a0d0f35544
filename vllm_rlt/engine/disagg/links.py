"""One engine core's ends of the K/V transport between prefill and decode cores
(engine/disagg/torch_connector.py): its own pool, shared with decode cores once, and the prefill
cores' pools it has opened. Under tensor parallelism every rank keeps its own: rank r of a
decode core reads rank r of a prefill core, whose heads are the same (both pools split the
model alike), so a core's pool travels as one handle per rank."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_rlt.engine.disagg.nixl_connector import NixlPeer, NixlSharedPool
from vllm_rlt.engine.disagg.torch_connector import KVPoolHandle, OpenedPools, SharedPool, share_pool
from vllm_rlt.worker.kv_pool import KVPool


class KVLinks:
    """This rank's shared pool (once `share` has run) and opened peers."""

    def __init__(self, local: Callable[[], KVPool], rank: int) -> None:
        self.local = local
        self.rank = rank
        self.shared: SharedPool | NixlSharedPool | None = None
        self.opened = OpenedPools(local)

    def share(self, connector: str) -> KVPoolHandle:
        """This rank's pool as decode cores read it, through `connector` (the first call
        decides it)."""
        if self.shared is None:
            self.shared = share_pool(self.local(), connector)
        return self.shared.handle

    def source(self, pools: Any) -> KVPool | NixlPeer | Any:
        """What this rank reads a handover from: a core's pool as one handle per rank
        (opened here once), or a pool already at hand (one process holding both cores)."""
        if isinstance(pools, list):
            return self.opened.open(pools[self.rank])
        return pools

    def close(self) -> None:
        if self.shared is not None:
            self.shared.close()
