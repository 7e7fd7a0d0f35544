"""Shared fixtures: the toy model in float32 and engines checked for leaks at teardown.

Without a GPU the suite runs torch on one CPU thread, here and in every process a test
starts (through OMP_NUM_THREADS): the test models are tiny, so a second thread only adds
synchronisation (3x slower on two cores), and on a loaded machine threads that wait for a
busy core made runs slower still. With a GPU each worker takes its share of the cores.
"""

from __future__ import annotations

import os
import shutil
import weakref

import pytest
import torch

from vllm_rlt.config import CacheConfig, ExecutionConfig, ExitConfig, SchedulerConfig
from vllm_rlt.engine.builder import build_engine_core
from vllm_rlt.engine.engine_core import EngineCore
from vllm_rlt.engine.llm_engine import LLMEngine
from vllm_rlt.engine_config import DeviceConfig, EngineConfig, ParallelConfig
from vllm_rlt.models.load import DEFAULT_MODEL_DIR
from vllm_rlt.models.ouro import OuroConfig, OuroModel
from vllm_rlt.models.toy import toy_config_dict, toy_weights
from vllm_rlt.tokenizer import Tokenizer

if not torch.cuda.is_available():
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # for the processes the tests start
else:
    # The GPU tier's workers share the host's cores (and several of its tests run a CPU
    # oracle): a default pool of a thread per core in every worker oversubscribes them.
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def toy_config() -> dict:
    return toy_config_dict()


@pytest.fixture(scope="session")
def toy_state() -> dict[str, torch.Tensor]:
    return toy_weights()


@pytest.fixture(scope="session")
def toy_model(toy_config, toy_state) -> OuroModel:
    return OuroModel(OuroConfig.from_dict(toy_config), toy_state, torch.float32, "cpu")


@pytest.fixture
def make_engine(toy_model):
    """Build EngineCores on the toy; every one must end with all blocks and slots free."""
    engines: list[EngineCore] = []

    def build(
        layout: str = "last_exited",
        exit_config: ExitConfig | None = None,
        num_blocks: int = 128,
        block_size: int = 4,
        async_scheduling: bool = False,
        enable_prefix_caching: bool = True,
        speculative_config=None,
        model: OuroModel | None = None,
        kv_cache_dtype: str = "auto",
        disaggregated: bool = False,
        **scheduler_kwargs,
    ) -> EngineCore:
        engine = build_engine_core(
            model or toy_model,
            Tokenizer.byte_level(),
            EngineConfig(
                cache_config=CacheConfig(
                    layout=layout,
                    num_blocks=num_blocks,
                    block_size=block_size,
                    enable_prefix_caching=enable_prefix_caching,
                    kv_cache_dtype=kv_cache_dtype,
                ),
                scheduler_config=SchedulerConfig(**scheduler_kwargs),
                exit_config=exit_config or ExitConfig(),
                execution_config=ExecutionConfig(async_scheduling=async_scheduling),
                speculative_config=speculative_config,
                device_config=DeviceConfig(attention_backend="torch"),
                parallel_config=ParallelConfig(disaggregate=(1, 1) if disaggregated else None),
            ),
        )
        engines.append(engine)
        return engine

    yield build
    for engine in engines:
        assert not engine.has_unfinished, "test left requests unfinished"
        assert engine.all_blocks_free(), "KV blocks leaked"
        assert sorted(engine.scheduler.free_slots) == list(
            range(engine.scheduler.config.max_num_seqs)
        ), "slots leaked"


_FRONTENDS: weakref.WeakKeyDictionary[EngineCore, LLMEngine] = weakref.WeakKeyDictionary()


def pool_entries(pool, blocks, num_positions: int, start: int = 0) -> torch.Tensor:
    """The rows of a `KVPool` holding positions [start, num_positions) of a completion in
    `blocks` (those of positions from 0), at every plane, plane by plane: computed position
    by position, apart from the run arithmetic the copies use."""
    positions = torch.arange(start, num_positions)
    table = torch.tensor(list(blocks), dtype=torch.int64)
    size = pool.block_size
    rows = table[positions // size] * size + positions % size
    planes = torch.arange(pool.planes).unsqueeze(1) * pool.slots_per_plane
    return (planes + rows).flatten().to(pool.k[0].device)


def frontend(engine: EngineCore) -> LLMEngine:
    """The frontend `LLM` runs in front of this core (the same one every call): requests
    added, stepped and aborted through it come back as outputs."""
    if engine not in _FRONTENDS:
        _FRONTENDS[engine] = LLMEngine(engine, engine.tokenizer)
    return _FRONTENDS[engine]


def drain(engine: EngineCore, arrivals: dict[int, list] | None = None, max_steps: int = 100000):
    """Step until idle through the core's frontend, adding (request_id, token_ids, params)
    items at the given steps.

    Returns {request_id: final RequestOutput}.
    """
    front = frontend(engine)
    arrivals = dict(arrivals or {})
    finished = {}
    step = 0
    while arrivals or front.has_unfinished:
        for request_id, ids, params in arrivals.pop(step, []):
            front.add_request(request_id, ids, params)
        for output in front.step():
            if output.finished:
                finished[output.request_id] = output
        step += 1
        assert step < max_steps, "engine did not drain"
    return finished


@pytest.fixture(scope="session")
def hub_cache(tmp_path_factory):
    """A hub cache holding the built-in checkpoint as `org/ouro-tasks`, laid out as the
    hub's client lays one out (refs/main names the snapshot)."""
    cache = tmp_path_factory.mktemp("hub")
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / "models--org--ouro-tasks"
    shutil.copytree(DEFAULT_MODEL_DIR, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return cache
