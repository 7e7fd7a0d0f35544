"""The K/V connector interface of prefill/decode disaggregation: how a decode core reads the
K/V a prefill core computed (engine/disagg/handover.py). A handover names blocks of the
prefill core's pool (`KVBlocks`); the connector says how that pool is reached.

A connector has two halves.

Scheduler half (what the decode core's scheduler asks about an imported request, whose
`Request.kv_import` is an `ImportedKV`, core/contract.py): which of its blocks are already
here and which must still arrive. Blocks this core's prefix cache holds are not read
again (core/known_blocks.py); a request whose early reads (prompt blocks read before its
handover, engine/disagg/prefetch.py) have not landed waits for them (`awaits_reads`). A
connector decides which reads exist; every peer pool it opens is read through one
interface (`PeerKVPool`, worker/kv_pool.py). A pool it maps here (`MappedPeer`) reads
`in_stream`: copies on this core's stream, ordered before every later pass. Any other
peer reads outside that stream, so its reads start behind the pass in flight, and the
blocks they bring count only once read.

Worker half, on every tensor-parallel rank (rank r of a decode core reads rank r of a
prefill core):
  share(pool: KVPool) -> SharedKV          the prefill side: its pool made readable until
                                           `close`; `handle` travels to decode cores
  open(handle, local) -> PeerKVPool        the decode side: the peer pool as read here
                                           (`local()` is this core's own pool)
  PeerKVPool.read_into(blocks, targets, start)
                                           a read done, or ordered (`in_stream`), on return
  PeerKVPool.start_read(blocks, targets, start, after) -> done marker | None
                                           a read that may end later (None: nothing to
                                           wait for)
  probe(peer, device)                      read something now: the start-up check
  forget(peer)                             its prefill core is gone
  missing() -> str | None                  why it cannot run here (checked at start-up)
  holds_local_pool                         this core's own pool is registered where it
                                           lies (it must not sleep)

A new connector is one module that defines a class implementing `KVConnector` and its
handle, a `PoolHandle` subclass tagged with the connector's name (the wire carries any
connector's handle: a msgspec tagged union), plus one line in `KV_CONNECTOR_CLASSES`
(vllm_rlt/config.py).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import msgspec
import torch

from vllm_rlt.worker.kv_pool import KVPool, PeerKVPool


class PoolHandle(msgspec.Struct, array_like=True):
    """What every connector's handle says of a prefill core's pool: its id, one tensor's
    `shape` and `dtype`, and how the tensors and blocks are laid out."""

    pool_id: str
    shape: list[int]
    dtype: str
    num_layers: int
    planes: int
    block_size: int

    @property
    def named_file(self) -> str | None:
        """A file that holds the pool, which someone must remove should its core die."""
        return None


def pool_fields(pool: KVPool) -> dict[str, Any]:
    """The `PoolHandle` fields of `pool`, under a new pool id."""
    first = pool.k[0]
    return dict(
        pool_id=uuid.uuid4().hex,
        shape=list(first.shape),
        dtype=str(first.dtype),
        num_layers=len(pool.k),
        planes=pool.planes,
        block_size=pool.block_size,
    )


class SharedKV(Protocol):
    """A prefill core's pool made readable by a connector, until `close`."""

    handle: PoolHandle

    def close(self) -> None: ...


class KVConnector(Protocol):
    """One way of moving K/V between engine cores' pools (see the module's docstring). One
    instance per engine rank: it keeps what reading needs across peers."""

    name: ClassVar[str]
    handle_type: ClassVar[type[PoolHandle]]

    @staticmethod
    def missing() -> str | None:
        """Why this connector cannot run here (None: it can)."""
        ...

    def share(self, pool: KVPool) -> SharedKV: ...

    def open(self, handle: Any, local: Callable[[], KVPool]) -> PeerKVPool: ...

    def probe(self, peer: Any, device: torch.device) -> None: ...

    def forget(self, peer: Any) -> None: ...

    @property
    def holds_local_pool(self) -> bool:
        """This core's own pool is registered at its present address (it must not move:
        no sleep)."""
        ...
