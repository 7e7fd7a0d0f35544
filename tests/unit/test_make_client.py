"""`make_client` picks the client class from the engine config, and the single core's
client answers the frontend's questions as one core: nothing lost, nothing to forget, a
stall only while the frontend has work."""

from __future__ import annotations

import time

import pytest

from vllm_rlt.config import ParamError
from vllm_rlt.engine.process import clients
from vllm_rlt.engine.process.core_client import EngineCoreClient
from vllm_rlt.engine_config import EngineConfig, ParallelConfig


class _Made:
    """Records how a client class was asked for, instead of starting cores."""

    def __init__(self, *args, **kwargs) -> None:
        self.how = ("started", type(self).__name__)

    @classmethod
    def attach(cls, *args):
        made = cls.__new__(cls)
        made.how = ("attached", cls.__name__)
        return made


class Single(_Made):
    pass


class Several(_Made):
    pass


class PrefillDecode(_Made):
    pass


@pytest.fixture
def recorded(monkeypatch):
    monkeypatch.setattr(clients, "EngineCoreClient", Single)
    monkeypatch.setattr(clients, "DataParallelClient", Several)
    monkeypatch.setattr(clients, "DisaggregatedClient", PrefillDecode)


def _how(parallel: ParallelConfig, **kwargs) -> tuple[str, str]:
    config = EngineConfig(parallel_config=parallel)
    return clients.make_client(config, lambda reason: None, **kwargs).how


def test_the_config_picks_the_client_class(recorded):
    assert _how(ParallelConfig()) == ("started", "Single")
    assert _how(ParallelConfig(data_parallel_size=2)) == ("started", "Several")
    assert _how(ParallelConfig(), remote_cores=object()) == ("started", "Several")
    assert _how(ParallelConfig(disaggregate=(1, 2))) == ("started", "PrefillDecode")
    assert _how(ParallelConfig(), attach=["core"]) == ("attached", "Single")
    two = ParallelConfig(data_parallel_size=2)
    assert _how(two, attach=["core 0", "core 1"]) == ("attached", "Several")
    with pytest.raises(ParamError, match="one attachment per data-parallel rank"):
        _how(two, attach=["core 0"])


def test_one_core_answers_as_one_core():
    client = EngineCoreClient.__new__(EngineCoreClient)
    client.process = None
    client._heard = time.monotonic() - 10.0
    assert client.size == 1 and client.processes == []
    assert client.lost_reason() is None and client.forget_core(0) == []
    assert client.stalled(5.0, busy=True) == "no pass completed for 5 s"
    assert client.stalled(5.0, busy=False) is None
    assert client.stalled(60.0, busy=True) is None
