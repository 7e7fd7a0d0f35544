"""An engine-core process's side of prefill/decode disaggregation (engine/pd_client.py):
its offers and early-lent prompt blocks, the imports and prefetches whose source blocks may
go, its pool as the host sees it and the prefill pools it has mapped, and the start-up
check of the transport."""

from __future__ import annotations

import base64
import dataclasses
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec

from vllm_rlt.engine.engine_core import EngineCore
from vllm_rlt.engine.kv_handover import HandedCompletion, KVHandover
from vllm_rlt.engine.kv_nixl import NixlSharedPool
from vllm_rlt.engine.kv_prefetch import PromptBlocks
from vllm_rlt.engine.kv_transport import KVPoolHandle, OpenedPools, SharedPool, share_pool
from vllm_rlt.engine.messages import HandedCompletionMessage, KVOffer, KVPrefetch


@dataclasses.dataclass
class HandoverNews:
    """What one client (frontend) hears next from this core: requests it ran to their
    first tokens (`offers`) and prompt blocks it lent before that (`prefetches`); imports
    and prefetches whose source blocks the prefill core may free (`imported`, `prefetched`:
    one request id per prefetch)."""

    offers: list[KVOffer] = dataclasses.field(default_factory=list)
    imported: list[str] = dataclasses.field(default_factory=list)
    prefetches: list[KVPrefetch] = dataclasses.field(default_factory=list)
    prefetched: list[str] = dataclasses.field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.offers or self.imported or self.prefetches or self.prefetched)


class CoreHandovers:
    """Per client (frontend), the `HandoverNews` to send."""

    def __init__(self, engine: EngineCore, clients: int) -> None:
        self.engine = engine
        self.news = [HandoverNews() for _ in range(clients)]
        self.import_client: dict[str, int] = {}
        self.prefetch_clients: deque[int] = deque()  # per prefetch in `ledger.prefetching`
        self.shared_pool: SharedPool | NixlSharedPool | None = None
        self.opened_pools = OpenedPools(lambda: engine.runner.kv_pool)

    def offer(self, handovers: list[KVHandover], client_of: Callable[[str], int]) -> None:
        """Offer each handed-over request to the client that sent it."""
        for handover in handovers:
            completions = [HandedCompletionMessage(**_fields(c)) for c in handover.completions]
            self.news[client_of(handover.request_id)].offers.append(
                KVOffer(
                    handover.request_id,
                    handover.prompt_token_ids,
                    handover.params,
                    completions,
                    self.share().handle,
                )
            )

    def lend_early(self, lent: list[PromptBlocks], client_of: Callable[[str], int]) -> None:
        """Tell each request's client of the prompt blocks lent before its handover."""
        for blocks in lent:
            self.news[client_of(blocks.request_id)].prefetches.append(
                KVPrefetch(
                    blocks.request_id,
                    blocks.prompt_token_ids,
                    blocks.first,
                    blocks.blocks,
                    self.share().handle,
                )
            )

    def prefetch(self, prefetch: KVPrefetch, client: int) -> None:
        """Copy a prefill core's early-lent prompt blocks here (`EngineCore.prefetch_kv`);
        its client hears once the copy is done (`collect_copied`). A pool that cannot be
        opened skips the copy."""
        try:
            source = self.opened_pools.open(prefetch.pool)
        except Exception:  # noqa: BLE001 - the import then fails or copies them itself
            source = None
        blocks = PromptBlocks(
            prefetch.request_id, prefetch.prompt_token_ids, prefetch.first_block, prefetch.blocks
        )
        self.engine.prefetch_kv(blocks, source)
        self.prefetch_clients.append(client)

    def share(self, connector: str = "torch") -> SharedPool | NixlSharedPool:
        """This core's pool as decode cores read it: shared through `connector` by the
        start-up check, before any handover."""
        if self.shared_pool is None:
            self.shared_pool = share_pool(self.engine.runner.kv_pool, connector)
        return self.shared_pool

    def importer(self, offer: KVOffer, client: int) -> Callable[[], None]:
        """What queues `offer` here: its K/V is copied from the prefill core's pool at
        admission. Its client hears once that copy is done (`collect_copied`), also when
        the import fails (`after_import`)."""
        self.import_client[offer.request_id] = client

        def queue() -> None:
            completions = [
                HandedCompletion(
                    **{
                        **msgspec.structs.asdict(c),
                        "top_logprobs": [tuple(map(tuple, top)) for top in c.top_logprobs],
                    }
                )
                for c in offer.completions
            ]
            pool = self.opened_pools.open(offer.pool)
            self.engine.import_request(
                KVHandover(
                    offer.request_id, offer.prompt_token_ids, offer.params, completions, pool
                )
            )

        return queue

    def after_import(self, request_id: str) -> None:
        ledger = self.engine.ledger
        if request_id not in ledger.importing and request_id not in ledger.unread:
            ledger.unread.append(request_id)  # refused before the engine saw it

    def collect_copied(self) -> None:
        ledger = self.engine.ledger
        for request_id in ledger.prefetched():  # before the imports they precede
            self.news[self.prefetch_clients.popleft()].prefetched.append(request_id)
        for request_id in ledger.copied():
            self.news[self.import_client.pop(request_id, 0)].imported.append(request_id)

    def control(self, name: str) -> dict[str, bool | str]:
        """The start-up check (engine/pd_client.py): "kv_share:CONNECTOR" makes this core's
        pool readable by decode cores through that connector and answers its handle
        (msgpack, base64); "kv_open:HANDLE" opens that pool here and reads from it."""
        try:
            if name.startswith("kv_share:"):
                handle = msgspec.msgpack.encode(self.share(name.removeprefix("kv_share:")).handle)
                return {"pool": base64.b64encode(handle).decode()}
            if name.startswith("kv_open:"):
                encoded = base64.b64decode(name.removeprefix("kv_open:"))
                pool = self.opened_pools.open(msgspec.msgpack.decode(encoded, type=KVPoolHandle))
                return {"opened": self.opened_pools.probe(pool, self.engine.model.device)}
        except Exception as exc:  # noqa: BLE001 - answered; the frontend refuses to start
            return {"error": f"{type(exc).__name__}: {exc}"}
        return {"error": f"unknown control call {name!r}"}

    def close(self) -> None:
        if self.shared_pool is not None:
            self.shared_pool.close()


def _fields(value) -> dict[str, Any]:
    """A dataclass's fields by name, the values themselves (no deep copy of tensors)."""
    return {field.name: getattr(value, field.name) for field in dataclasses.fields(value)}
