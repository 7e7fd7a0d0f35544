"""An engine-core process's side of prefill/decode disaggregation (engine/pd_client.py):
its offers, the imports whose source blocks may go, its pool as the host sees it and the
prefill pools it has mapped, and the start-up check of the transport."""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Callable
from typing import Any

import msgspec

from vllm_rlt.engine.engine_core import EngineCore
from vllm_rlt.engine.kv_handover import HandedCompletion, KVHandover
from vllm_rlt.engine.kv_nixl import NixlSharedPool
from vllm_rlt.engine.kv_transport import KVPoolHandle, OpenedPools, SharedPool, share_pool
from vllm_rlt.engine.messages import HandedCompletionMessage, KVOffer


class CoreHandovers:
    """Per client (frontend): requests this core ran to their first tokens (`offers`)
    and imports whose source blocks the prefill core may free (`imported`)."""

    def __init__(self, engine: EngineCore, clients: int) -> None:
        self.engine = engine
        self.offers: list[list[KVOffer]] = [[] for _ in range(clients)]
        self.imported: list[list[str]] = [[] for _ in range(clients)]
        self.import_client: dict[str, int] = {}
        self.shared_pool: SharedPool | NixlSharedPool | None = None
        self.opened_pools = OpenedPools(lambda: engine.runner.kv_pool)

    def offer(self, handovers: list[KVHandover], client_of: Callable[[str], int]) -> None:
        """Offer each handed-over request to the client that sent it."""
        for handover in handovers:
            completions = [HandedCompletionMessage(**_fields(c)) for c in handover.completions]
            self.offers[client_of(handover.request_id)].append(
                KVOffer(
                    handover.request_id,
                    handover.prompt_token_ids,
                    handover.params,
                    completions,
                    self.share().handle,
                )
            )

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
        for request_id in self.engine.ledger.copied():
            self.imported[self.import_client.pop(request_id, 0)].append(request_id)

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
