"""An engine-core process's side of prefill/decode disaggregation (engine/process/pd_client.py):
its offers and early-lent prompt blocks, the imports and prefetches whose source blocks may
go, and the start-up check of the transport. The pools themselves are the engine's
(`EngineCore.disagg`), on every tensor-parallel rank (engine/disagg/links.py)."""

from __future__ import annotations

import base64
import dataclasses
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec

from vllm_rlt.engine.disagg.connector import PoolHandle
from vllm_rlt.engine.disagg.engine_side import Disaggregation
from vllm_rlt.engine.disagg.handover import HandedCompletion, KVHandover
from vllm_rlt.engine.disagg.prefetch import PromptBlocks
from vllm_rlt.engine.disagg.registry import DEFAULT, KVPoolHandle
from vllm_rlt.engine.process.messages import HandedCompletionMessage, KVOffer, KVPrefetch


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

    def __init__(self, disagg: Disaggregation, clients: int) -> None:
        self.disagg = disagg
        self.news = [HandoverNews() for _ in range(clients)]
        self.import_client: dict[str, int] = {}
        self.prefetch_clients: deque[int] = deque()  # per prefetch in `ledger.prefetching`
        self.pools: list[PoolHandle] | None = None  # this core's, a handle per rank
        self.reached = False  # the import being queued reached the engine

    def after_step(
        self, client_of: Callable[[str], int], client_of_offer: Callable[[str], int]
    ) -> None:
        """Tell each request's client (`client_of`) of the prompt blocks lent before its
        handover, then offer each handed-over request to the client that sent it
        (`client_of_offer`: it leaves this core)."""
        self.lend_early(self.disagg.take_prefetches(), client_of)
        self.offer(self.disagg.take_handovers(), client_of_offer)

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
                    self.share(),
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
                    self.share(),
                )
            )

    def prefetch(self, prefetch: KVPrefetch, client: int) -> None:
        """Copy a prefill core's early-lent prompt blocks here (`Disaggregation.prefetch_kv`);
        its client hears once the copy is done (`collect_copied`)."""
        blocks = PromptBlocks(
            prefetch.request_id, prefetch.prompt_token_ids, prefetch.first_block, prefetch.blocks
        )
        self.disagg.prefetch_kv(blocks, prefetch.pools)
        self.prefetch_clients.append(client)

    def share(self, connector: str = DEFAULT) -> list[PoolHandle]:
        """This core's pool as decode cores read it, a handle per tensor-parallel rank:
        shared through `connector` by the start-up check, before any handover."""
        if self.pools is None:
            self.pools = self.disagg.share_kv(connector)
        return self.pools

    def importer(self, offer: KVOffer, client: int) -> Callable[[], None]:
        """What queues `offer` here: its K/V is copied from the prefill core's pool at
        admission. Its client hears once that copy is done (`collect_copied`), also when
        the import fails (`after_import`)."""
        self.import_client[offer.request_id] = client
        self.reached = False

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
            self.reached = True
            self.disagg.import_request(
                KVHandover(
                    offer.request_id, offer.prompt_token_ids, offer.params, completions, offer.pools
                )
            )

        return queue

    def after_import(self, request_id: str) -> None:
        if not self.reached:  # refused before the engine saw it (which reports its own)
            self.disagg.refuse_import(request_id)

    def collect_copied(self) -> None:
        ledger = self.disagg.ledger
        if not (ledger.prefetching or ledger.importing):
            return
        prefetched, copied = self.disagg.collect_transfers()
        for request_id in prefetched:  # before the imports they precede
            self.news[self.prefetch_clients.popleft()].prefetched.append(request_id)
        for request_id in copied:
            self.news[self.import_client.pop(request_id, 0)].imported.append(request_id)

    def control(self, name: str) -> dict[str, bool | str]:
        """The start-up check (engine/process/pd_client.py): "kv_share:CONNECTOR" makes this core's
        pool readable by decode cores through that connector and answers its handle
        (msgpack, base64); "kv_open:HANDLE" opens that pool here and reads from it."""
        try:
            if name.startswith("kv_share:"):
                pools = msgspec.msgpack.encode(self.share(name.removeprefix("kv_share:")))
                return {"pool": base64.b64encode(pools).decode()}
            if name.startswith("kv_open:"):
                encoded = base64.b64decode(name.removeprefix("kv_open:"))
                pools = msgspec.msgpack.decode(encoded, type=list[KVPoolHandle])
                error = self.disagg.open_kv(pools)
                return {"opened": True} if error is None else {"error": error}
        except Exception as exc:  # noqa: BLE001 - answered; the frontend refuses to start
            return {"error": f"{type(exc).__name__}: {exc}"}
        return {"error": f"unknown control call {name!r}"}

    def close(self) -> None:
        self.disagg.close()  # the other ranks close theirs as they stop


def _fields(value) -> dict[str, Any]:
    """A dataclass's fields by name, the values themselves (no deep copy of tensors)."""
    return {field.name: getattr(value, field.name) for field in dataclasses.fields(value)}
