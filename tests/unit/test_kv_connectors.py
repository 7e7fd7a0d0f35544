"""engine/disagg/registry.py: connectors are found by name ("auto": the default), an
unknown name is refused naming the field and the names it takes, and any connector's
pool handle crosses the wire as itself and leads back to its connector."""

from __future__ import annotations

import msgspec
import pytest

from vllm_rlt.config import ParamError
from vllm_rlt.engine.disagg.nixl_connector import NixlConnector, NixlPoolHandle
from vllm_rlt.engine.disagg.registry import (
    CONNECTORS,
    KVPoolHandle,
    connector_class,
    connector_of,
)
from vllm_rlt.engine.disagg.torch_connector import TorchConnector, TorchPoolHandle


def test_connectors_are_found_by_name_and_an_unknown_one_is_refused_naming_the_field():
    assert connector_class("auto") is TorchConnector
    assert connector_class("torch") is TorchConnector
    assert connector_class("nixl") is NixlConnector
    assert all(connector.name == name for name, connector in CONNECTORS.items())
    with pytest.raises(ParamError) as raised:
        connector_class("nccl")
    assert str(raised.value) == "kv_connector must be one of auto, torch, nixl, got 'nccl'"
    assert raised.value.param == "kv_connector"


def test_each_connectors_handle_crosses_the_wire_as_itself():
    common = ("p", [8, 2, 4], "torch.float32", 2, 1, 4)
    handles = [
        TorchPoolHandle(*common, kind="shm", name="/proc/1/fd/3"),
        NixlPoolHandle(*common, agent=b"meta", regions=[[1, 2, 0]], memory="DRAM"),
    ]
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(handles), type=list[KVPoolHandle])
    assert decoded == handles
    assert [connector_of(handle) for handle in decoded] == [TorchConnector, NixlConnector]
    assert [handle.named_file for handle in decoded] == [None, None]
