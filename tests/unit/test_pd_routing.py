"""DisaggregatedClient's routing with stand-in cores: an abort that reaches a prefill core
after its offer left follows the offer to the decode core, and a decode core's copy
releases the prefill core's staged one."""

from __future__ import annotations

import time
import types

from vllm_rlt.engine.messages import (
    AbortAll,
    AbortRequest,
    AddRequest,
    ImportRequest,
    KVOffer,
    ReleaseHandover,
)
from vllm_rlt.engine.pd_client import DisaggregatedClient
from vllm_rlt.sampling_params import SamplingParams


class _Core:
    def __init__(self) -> None:
        self.sent: list = []
        self.client = 0
        self.info = types.SimpleNamespace(max_num_seqs=4)

    def send(self, command) -> None:
        self.sent.append(command)


def _client() -> DisaggregatedClient:
    """One prefill and one decode stand-in core, without processes."""
    client = DisaggregatedClient.__new__(DisaggregatedClient)
    client.num_prefill = 1
    client._staged_at, client._staged_files, client._early_aborts = {}, {}, {}
    client._prepare(lambda reason: None, None)
    client.cores = [_Core(), _Core()]
    client.client, client._owner = 0, {}
    client._sequences, client._kv_usage = [0, 0], [0.0, 0.0]
    client._heard = [time.monotonic()] * 2
    return client


def _outputs(offers=(), imported=()):
    stats = types.SimpleNamespace(num_free_blocks=1, num_blocks=1)
    return types.SimpleNamespace(
        offers=list(offers), imported=list(imported), requests=[], stats=stats
    )


def test_aborts_sent_before_an_offer_arrives_follow_it():
    client = _client()
    params = SamplingParams(max_tokens=5)
    for request_id in ("one", "all"):
        client.send(AddRequest(request_id, [1, 2, 3], params))
    assert all(c.handover for c in client.cores[0].sent)  # prefill cores hand over
    client.send(AbortRequest("one"))
    client.send(AbortAll(0))
    for request_id in ("one", "all"):  # both left their prefill core before the aborts
        client._outputs(0, lambda outputs: None, _outputs([KVOffer(request_id, [1], params, [])]))
    decode = client.cores[1].sent
    imports = [i for i, c in enumerate(decode) if isinstance(c, ImportRequest)]
    aborts = {c.request_id for c in decode if isinstance(c, AbortRequest)}
    assert len(imports) == 2 and aborts == {"one", "all"}
    assert all(isinstance(c, AbortRequest) for c in decode[imports[0] + 1 : imports[0] + 3])
    assert client._owner["one"][0] == 1 and client._sequences == [0, 2]
    client._outputs(1, lambda outputs: None, _outputs(imported=["one"]))
    assert isinstance(client.cores[0].sent[-1], ReleaseHandover)
    assert client.cores[0].sent[-1].request_id == "one"
