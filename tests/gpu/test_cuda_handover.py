"""Prefill/decode handover on one GPU: two engine cores (Triton kernels, CUDA graphs,
asynchronous scheduling) give what one core gives, in both per-plane layouts, with the K/V
read through CUDA IPC from another process's pool, or through NIXL where it is installed."""

from __future__ import annotations

import json
import multiprocessing
import re
import urllib.request

import msgspec
import pytest
import torch

from tests.unit.test_kv_handover import _assert_same, _colocated, _disaggregated, _requests
from vllm_rlt import CacheConfig, ExecutionConfig, SamplingParams, SchedulerConfig
from vllm_rlt.bench.serve_launch import launched
from vllm_rlt.engine.builder import build_engine_core
from vllm_rlt.engine.disagg.links import OpenedPools
from vllm_rlt.engine.disagg.nixl_connector import NixlConnector
from vllm_rlt.engine.disagg.registry import KVPoolHandle
from vllm_rlt.engine.disagg.torch_connector import SharedPool
from vllm_rlt.engine_config import DeviceConfig, EngineConfig, ParallelConfig
from vllm_rlt.models.ouro import OuroConfig, OuroModel
from vllm_rlt.tokenizer import Tokenizer
from vllm_rlt.worker.kv_pool import KVPool

pytestmark = pytest.mark.gpu


def _engine(model, layout, batched: int = 128, disaggregated: bool = False):
    return build_engine_core(
        model,
        Tokenizer.byte_level(),
        EngineConfig(
            cache_config=CacheConfig(layout=layout, num_blocks=256, block_size=4),
            scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=batched),
            execution_config=ExecutionConfig(cuda_graphs=True, async_scheduling=True),
            device_config=DeviceConfig(attention_backend="triton"),
            parallel_config=ParallelConfig(disaggregate=(1, 1) if disaggregated else None),
        ),
    )


@pytest.mark.parametrize("layout", ["last_exited", "shared_decode"])
def test_cuda_handover_equals_one_core(toy_config, toy_state, exact_float32, layout):
    model = OuroModel(OuroConfig.from_dict(toy_config), toy_state, torch.float32, "cuda")
    expected = _colocated(_engine(model, layout), _requests())
    prefill, decode = (
        _engine(model, layout, disaggregated=True),
        _engine(model, layout, disaggregated=True),
    )
    got, handed = _disaggregated(prefill, decode, _requests())
    _assert_same(got, expected)
    assert handed and prefill.all_blocks_free() and decode.all_blocks_free()  # released


@pytest.mark.parametrize("layout", ["last_exited", "shared"])
def test_cuda_blocks_moved_while_later_chunks_run_equal_one_core(
    toy_config, toy_state, exact_float32, layout
):
    """Chunks of 8 positions: each finished block is copied on the device (ordered by an
    event) while later chunks run, and the outputs equal one core's."""
    model = OuroModel(OuroConfig.from_dict(toy_config), toy_state, torch.float32, "cuda")
    prompt = [(7 * i) % 90 + 3 for i in range(45)]
    requests = [
        ("long", prompt, SamplingParams(max_tokens=6, temperature=0.0)),
        ("fanout", prompt[:33], SamplingParams(max_tokens=5, temperature=0.8, seed=4, n=2)),
    ]
    expected = _colocated(_engine(model, layout, 8), requests)
    prefill, decode = _engine(model, layout, 8, True), _engine(model, layout, 8, True)
    lent = []
    take = prefill.disagg.take_prefetches
    prefill.disagg.take_prefetches = lambda: lent.extend(taken := take()) or taken
    got, _ = _disaggregated(prefill, decode, requests)
    _assert_same(got, expected)
    assert len(lent) >= 3 and prefill.all_blocks_free() and decode.all_blocks_free()


@pytest.mark.parametrize("layout", ["last_exited", "shared_decode"])
def test_cuda_handover_through_nixl_equals_one_core(toy_config, toy_state, exact_float32, layout):
    pytest.importorskip("nixl._api")
    model = OuroModel(OuroConfig.from_dict(toy_config), toy_state, torch.float32, "cuda")
    expected = _colocated(_engine(model, layout), _requests())
    prefill, decode = (
        _engine(model, layout, disaggregated=True),
        _engine(model, layout, disaggregated=True),
    )
    shared = NixlConnector().share(prefill.runner.kv_pool)
    try:
        peer = OpenedPools(lambda: decode.runner.kv_pool).open(shared.handle)
        assert shared.handle.memory == "VRAM"
        got, handed = _disaggregated(prefill, decode, _requests(), source=peer)
    finally:
        shared.close()
    _assert_same(got, expected)
    assert handed and prefill.all_blocks_free() and decode.all_blocks_free()


def _share_in_child(queue, done) -> None:
    generator = torch.Generator().manual_seed(0)
    k = [torch.randn(2 * 12, 3, 8, generator=generator).to("cuda", torch.bfloat16)]
    v = [torch.randn(2 * 12, 3, 8, generator=generator).to("cuda", torch.bfloat16)]
    shared = SharedPool(KVPool(k, v, planes=2, block_size=4))
    torch.cuda.synchronize()
    queue.put(msgspec.msgpack.encode(shared.handle))
    done.wait(120)  # the pool lives until the reader has its copy


def test_cuda_ipc_maps_another_process_pool():
    context = multiprocessing.get_context("spawn")
    queue, done = context.Queue(), context.Event()
    child = context.Process(target=_share_in_child, args=(queue, done))
    child.start()
    handle = msgspec.msgpack.decode(queue.get(timeout=120), type=KVPoolHandle)
    assert handle.kind == "cuda_ipc"
    pool = OpenedPools().open(handle).pool
    got = [t.clone() for t in [*pool.k, *pool.v]]
    torch.cuda.synchronize()
    done.set()
    child.join(timeout=120)
    assert child.exitcode == 0
    generator = torch.Generator().manual_seed(0)
    for tensor in got:
        want = torch.randn(2 * 12, 3, 8, generator=generator).to("cuda", torch.bfloat16)
        assert torch.equal(tensor, want)


def _served_texts(flags: tuple[str, ...], prompts: list[str]) -> tuple[list[str], str]:
    """Greedy completions of `prompts`, one request at a time, and the final scrape."""
    with launched(["vllm_rlt.entrypoints.cli", "serve", "toy"], list(flags), {}) as url:
        texts = []
        for prompt in prompts:
            body = {"model": "toy", "prompt": prompt, "max_tokens": 12, "temperature": 0}
            request = urllib.request.Request(
                f"{url}/v1/completions",
                json.dumps(body).encode(),
                {"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=120) as reply:
                texts.append(json.load(reply)["choices"][0]["text"])
        with urllib.request.urlopen(f"{url}/metrics", timeout=60) as reply:
            return texts, reply.read().decode()


@pytest.mark.long
@pytest.mark.parametrize("layout", ["last_exited", "shared_decode"])
def test_served_handover_over_cuda_ipc_moves_chunks_early_and_equals_one_engine(layout):
    """`serve --disaggregate 1:1` on one GPU: the decode core maps the prefill core's pool
    through CUDA IPC, and prompts run in chunks of 16 move their finished blocks (every
    plane, or the final one) while later chunks run. Each request alone (a batch of one on
    either server) gives the text one engine gives with the same chunks."""
    prompts = [f"prompt {i} " + "with several words " * (4 + 6 * i) for i in range(3)]
    common = ("--device", "cuda", "--dtype", "float32", "--prefill-chunk-size", "16")
    # a fixed pool: sized from free memory, each core would take most of the card while the
    # suite's other workers run
    common += ("--kv-layout", layout, "--num-blocks", "512")
    expected, _ = _served_texts(common, prompts)
    flags = (*common, "--disaggregate", "1:1", "--kv-connector", "torch")
    got, scrape = _served_texts(flags, prompts)
    assert got == expected
    early = re.search(r"^vllm_rlt:kv_transfer_prefetched_blocks_total (\S+)$", scrape, re.M)
    assert early and float(early.group(1)) > 0
