"""DisaggregatedClient's routing with stand-in cores: an abort that reaches a prefill core
after its offer left follows the offer to the decode core, and a decode core's copy
frees the prefill core's lent blocks, and a lost core's handovers are cleaned up."""

from __future__ import annotations

import base64
import time
import types

import msgspec
import pytest

from vllm_rlt.config import ParamError
from vllm_rlt.engine.disagg.nixl_connector import NixlConnector
from vllm_rlt.engine.disagg.torch_connector import TorchPoolHandle
from vllm_rlt.engine.process.messages import (
    AbortAll,
    AbortRequest,
    AddRequest,
    ForgetKVPool,
    ImportRequest,
    KVOffer,
    KVPrefetch,
    PrefetchKV,
    ReleaseHandover,
)
from vllm_rlt.engine.process.pd_client import DisaggregatedClient
from vllm_rlt.engine_config import EngineConfig, ParallelConfig
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
    client.kv_connector = "torch"
    client._lent_by, client._pool_files, client._early_aborts = {}, {}, {}
    client._pool_ids, client._prefetch_target, client._prefetch_lent = {}, {}, {}
    client._prepare(lambda reason: None, None)
    client.cores = [_Core(), _Core()]
    client.client, client._owner = 0, {}
    client._sequences, client._kv_usage = [0, 0], [0.0, 0.0]
    client._heard = [time.monotonic()] * 2
    return client


def _outputs(offers=(), imported=(), prefetches=(), prefetched=()):
    stats = types.SimpleNamespace(num_free_blocks=1, num_blocks=1)
    return types.SimpleNamespace(
        offers=list(offers),
        imported=list(imported),
        prefetches=list(prefetches),
        prefetched=list(prefetched),
        requests=[],
        stats=stats,
    )


def _offer(request_id: str, params: SamplingParams) -> KVOffer:
    pool = TorchPoolHandle("p", [1], "torch.float32", 1, 1, 1, "cuda_ipc")
    return KVOffer(request_id, [1], params, [], [pool])


def test_aborts_sent_before_an_offer_arrives_follow_it():
    client = _client()
    params = SamplingParams(max_tokens=5)
    for request_id in ("one", "all"):
        client.send(AddRequest(request_id, [1, 2, 3], params))
    assert all(c.handover for c in client.cores[0].sent)  # prefill cores hand over
    client.send(AbortRequest("one"))
    client.send(AbortAll(0))
    for request_id in ("one", "all"):  # both left their prefill core before the aborts
        client._outputs(0, lambda outputs: None, _outputs([_offer(request_id, params)]))
    decode = client.cores[1].sent
    imports = [i for i, c in enumerate(decode) if isinstance(c, ImportRequest)]
    aborts = {c.request_id for c in decode if isinstance(c, AbortRequest)}
    assert len(imports) == 2 and aborts == {"one", "all"}
    assert all(isinstance(c, AbortRequest) for c in decode[imports[0] + 1 : imports[0] + 3])
    assert client._owner["one"][0] == 1 and client._sequences == [0, 2]
    client._outputs(1, lambda outputs: None, _outputs(imported=["one"]))
    assert isinstance(client.cores[0].sent[-1], ReleaseHandover)
    assert client.cores[0].sent[-1].request_id == "one"


def test_an_id_sent_again_as_its_last_delta_arrives_is_handed_over_with_its_aborts():
    """The frontend sends a new request of an id the moment the old one's last delta
    reaches it (engine/held_commands.py), from inside this client's output handling: the
    new one still goes to a prefill core to be handed over, and the abort of one of its
    completions, sent with it, follows its offer to the decode core."""
    client = _client()
    client.send(AddRequest("x", [1, 2, 3], SamplingParams(max_tokens=5)))
    again = SamplingParams(max_tokens=5, n=2, temperature=1.0, seed=0)

    def frontend(outputs) -> None:
        client.send(AddRequest("x", [4, 5], again))
        client.send(AbortRequest("x", 1))

    finished = _outputs()
    finished.requests = [types.SimpleNamespace(request_id="x", finished=True)]
    client._outputs(0, frontend, finished)
    assert client.cores[0].sent[-2].handover and client.cores[0].sent[-2].params.n == 2
    client._outputs(0, lambda outputs: None, _outputs([_offer("x", again)]))
    assert client.cores[1].sent[-1] == AbortRequest("x", 1)
    assert isinstance(client.cores[1].sent[-2], ImportRequest)


def test_an_id_is_held_until_its_lent_blocks_are_reported_copied():
    """The decode core answers an abort at once but reports the copy of the blocks lent to
    it later; those records are kept by id, so the frontend holds a new request of the id
    until then (`holds`)."""
    client = _client()
    params = SamplingParams(max_tokens=5)
    client.send(AddRequest("x", [1, 2, 3], params))
    assert client.holds("x")  # running on the prefill core
    client._outputs(0, lambda outputs: None, _outputs([_offer("x", params)]))
    client.send(AbortRequest("x"))
    finished = _outputs()
    finished.requests = [types.SimpleNamespace(request_id="x", finished=True)]
    client._outputs(1, lambda outputs: None, finished)
    assert "x" not in client._owner and client.holds("x")  # the copy is not reported yet
    client._outputs(1, lambda outputs: None, _outputs(imported=["x"]))
    assert not client.holds("x") and _releases(client.cores[0]) == ["x"]


def _prefetch(request_id: str, first: int) -> KVPrefetch:
    pool = TorchPoolHandle("p", [1], "torch.float32", 1, 1, 1, "cuda_ipc")
    return KVPrefetch(request_id, [1] * 4 * (first + 1), first, [first], [pool])


def _releases(core) -> list[str]:
    return [c.request_id for c in core.sent if isinstance(c, ReleaseHandover)]


def test_early_lent_blocks_go_to_the_decode_core_that_later_takes_the_request():
    """Prefetches go to the decode core chosen at the first of them, the offer follows
    them there, and each copy done frees one lend at the prefill core before the import's."""
    client = _client()
    client.cores.append(_Core())  # a second decode core
    client._sequences.append(0)
    client._kv_usage.append(0.0)
    client._heard.append(time.monotonic())
    params = SamplingParams(max_tokens=5)
    client.send(AddRequest("long", [1] * 12, params))
    client._sequences[1] = 3  # the first decode core is busier: the second one is chosen
    for first in (0, 1):
        client._outputs(0, lambda outputs: None, _outputs(prefetches=[_prefetch("long", first)]))
    client._sequences[1], client._sequences[2] = 0, 3  # now the other is less loaded
    client._outputs(0, lambda outputs: None, _outputs([_offer("long", params)]))
    target = client.cores[2].sent
    assert [type(c) for c in target] == [PrefetchKV, PrefetchKV, ImportRequest]
    assert [c.prefetch.first_block for c in target[:2]] == [0, 1]
    assert not client.cores[1].sent and client._owner["long"][0] == 2
    client._outputs(2, lambda outputs: None, _outputs(prefetched=["long"]))
    assert _releases(client.cores[0]) == ["long"]
    client._outputs(2, lambda outputs: None, _outputs(imported=["long"], prefetched=["long"]))
    assert _releases(client.cores[0]) == ["long"] * 3
    assert not client._prefetch_lent and not client._lent_by and not client._prefetch_target


def test_early_lent_blocks_are_freed_when_their_decode_core_is_lost_or_absent():
    client = _client()
    params = SamplingParams(max_tokens=5)
    client.send(AddRequest("r", [1] * 12, params))
    for first in (0, 1, 2):
        client._outputs(0, lambda outputs: None, _outputs(prefetches=[_prefetch("r", first)]))
    client._outputs(1, lambda outputs: None, _outputs(prefetched=["r"]))
    client.lost[1] = "killed"
    client.forget_core(1)
    assert _releases(client.cores[0]) == ["r"] * 3 and not client._prefetch_lent
    # No decode core left: a later prefetch is released at once.
    client._outputs(0, lambda outputs: None, _outputs(prefetches=[_prefetch("r", 3)]))
    assert _releases(client.cores[0]) == ["r"] * 4


def test_a_lost_core_frees_what_its_handovers_held(tmp_path):
    """A lost decode core: the blocks lent for its imports are freed at their prefill core.
    A lost prefill core: its pool's files (one per tensor-parallel rank) are removed."""
    client = _client()
    params = SamplingParams(max_tokens=5)
    pool_files = [tmp_path / f"vllm-rlt-kv-pool-{rank}" for rank in range(2)]
    for pool_file in pool_files:
        pool_file.write_bytes(b"\0" * 8)
    client._pool_files[0] = [str(pool_file) for pool_file in pool_files]  # start-up check
    for request_id in ("a", "b"):
        client.send(AddRequest(request_id, [1, 2, 3], params))
        client._outputs(0, lambda outputs: None, _outputs([_offer(request_id, params)]))
    client._outputs(1, lambda outputs: None, _outputs(imported=["a"]))
    client._owner.pop("b")  # it finished on the decode core before its copy was reported
    client.lost[1] = "killed"
    assert client.forget_core(1) == ["a"]  # "b" already ended there
    releases = [c.request_id for c in client.cores[0].sent if isinstance(c, ReleaseHandover)]
    assert releases == ["a", "b"] and not client._lent_by
    assert all(pool_file.exists() for pool_file in pool_files)  # its prefill core runs
    client.lost[0] = "killed"
    client.forget_core(0)
    assert not any(pool_file.exists() for pool_file in pool_files)


def test_a_lost_prefill_core_pool_is_let_go_by_the_decode_cores():
    client = _client()
    client._pool_ids[0] = ["pool-0", "pool-0-rank-1"]
    client.lost[0] = "killed"
    client.forget_core(0)
    assert [c for c in client.cores[1].sent if isinstance(c, ForgetKVPool)] == [
        ForgetKVPool("pool-0"),
        ForgetKVPool("pool-0-rank-1"),
    ]
    assert not client._pool_ids


def test_a_transfer_that_cannot_work_stops_the_start_naming_both_cores():
    client = _client()
    handle = TorchPoolHandle("p", [1], "torch.float32", 1, 1, 1, "cuda_ipc")
    encoded = base64.b64encode(msgspec.msgpack.encode([handle])).decode()
    client.cores[0].call = lambda name, timeout: {"kv_share:torch": {"pool": encoded}}[name]
    client.cores[1].call = lambda name, timeout: (
        {"error": "RuntimeError: peer access is not available"}
        if name == f"kv_open:{encoded}"
        else {"error": f"unexpected call {name}"}
    )
    with pytest.raises(RuntimeError) as raised:
        client._check_transport()
    assert str(raised.value) == (
        "--disaggregate: decode engine core 1 cannot read the KV pool of prefill engine core "
        "0: RuntimeError: peer access is not available"
    )
    client.cores[1].call = lambda name, timeout: {"opened": True}
    client._check_transport()

    def dies(name, timeout):
        raise TimeoutError(f"the engine core did not answer {name!r} within {timeout} s")

    client.cores[1].call = dies
    with pytest.raises(RuntimeError) as raised:
        client._check_transport()
    assert str(raised.value) == (
        "--disaggregate: the K/V transport check (decode engine core 1 and prefill engine core "
        "0) failed: TimeoutError"
    )


def test_the_python_api_checks_its_kv_connector_before_starting_cores(monkeypatch):
    with pytest.raises(ParamError, match="kv_connector must be one of auto, torch, nixl"):
        ParallelConfig(disaggregate=(1, 1), kv_connector="nccl")
    monkeypatch.setattr(
        NixlConnector, "missing", staticmethod(lambda: "the nixl package is not installed")
    )
    nixl = EngineConfig(parallel_config=ParallelConfig(disaggregate=(1, 1), kv_connector="nixl"))
    with pytest.raises(ParamError, match="nixl: the nixl package is not installed") as raised:
        DisaggregatedClient(nixl, lambda reason: None)
    assert raised.value.param == "kv_connector"
