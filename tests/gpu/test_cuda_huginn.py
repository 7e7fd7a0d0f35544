"""A tiny Huginn checkpoint on CUDA in float32 against the serial CPU oracle: each attention
backend, eagerly and with CUDA graphs and asynchronous scheduling, at a fixed depth and
under the latent-change criterion, also speculating; and a bf16 engine that runs."""

from __future__ import annotations

import pytest
import torch

from tests.reference.huginn_checkpoint import write_tiny_huginn
from tests.reference.huginn_match import PROMPTS, SEEDS, assert_matches_oracle
from tests.reference.huginn_oracle import HuginnModel, huginn_generate
from vllm_rlt import LLM, SamplingParams, SpeculativeConfig
from vllm_rlt.config import (
    CacheConfig,
    ExecutionConfig,
    ExitConfig,
    SchedulerConfig,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("huginn")
    write_tiny_huginn(path, seed=5)
    return path


def _llm(
    folder,
    backend: str,
    fast: bool,
    layout: str,
    mode: str,
    dtype="float32",
    sync_passes=1,
    draft_loops: int | None = None,
) -> LLM:
    spec = None
    if draft_loops is not None:
        spec = SpeculativeConfig(num_speculative_tokens=3, draft_loops=draft_loops)
    return LLM(
        model=str(folder),
        dtype=dtype,
        device="cuda",
        attention_backend=backend,
        cache_config=CacheConfig(layout=layout, num_blocks=96, block_size=4),
        scheduler_config=SchedulerConfig(
            max_num_seqs=4, max_num_batched_tokens=8 if draft_loops is None else 16
        ),
        exit_config=ExitConfig(mode=mode, sync_passes=sync_passes),
        execution_config=ExecutionConfig(cuda_graphs=fast, async_scheduling=fast),
        speculative_config=spec,
    )


@pytest.mark.long
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("fast", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize(
    ("layout", "lookup", "threshold"),
    [("last_exited", "latest", 0.0), ("shared", "final", 0.0), ("last_exited", "latest", 0.5)],
)
def test_cuda_huginn_equals_the_oracle(
    folder, exact_float32, backend, fast, layout, lookup, threshold
):
    llm = _llm(folder, backend, fast, layout, "latent_diff")
    _check(llm, HuginnModel.from_folder(folder), lookup, threshold)


@pytest.mark.long
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_huginn_exits_held_together_equal_the_oracle(folder, exact_float32, backend):
    """Exits held back to come together (sync_passes 3: the decision taken in the stack
    graph, held rows frozen) under the latent criterion, with graphs on Triton and
    asynchronous scheduling: the oracle's tokens, exit depths and logprobs."""
    llm = _llm(folder, backend, True, "last_exited", "latent_diff", sync_passes=3)
    _check(llm, HuginnModel.from_folder(folder), "latest", 0.5)


@pytest.mark.long
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("fast", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize(("threshold", "draft_loops"), [(0.0, 3), (0.9, 2)])
def test_cuda_huginn_speculation_equals_the_oracle(
    folder, exact_float32, backend, fast, threshold, draft_loops
):
    """Drafting lanes read out through the coda at the draft depth, and a lane held while
    its token was a draft reads out from its kept state once accepted: with graphs, the
    mixed graphs' stack decides which rows read out."""
    llm = _llm(folder, backend, fast, "last_exited", "latent_diff", draft_loops=draft_loops)
    _check(llm, HuginnModel.from_folder(folder), "latest", threshold)
    assert llm.engine.scheduler.num_drafted > 0


def _check(llm: LLM, model: HuginnModel, lookup: str, threshold: float) -> None:
    """Every prompt, batched, against the oracle run one request at a time: tokens, exit
    depths and logprobs, and no block left taken."""
    params = [
        SamplingParams(
            max_tokens=6,
            temperature=0.0,
            seed=s,
            ignore_eos=True,
            logprobs=2,
            exit_threshold=threshold,
        )
        for s in SEEDS
    ]
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, seed, output in zip(PROMPTS, SEEDS, outputs, strict=True):
        criterion = "latent-diff" if threshold else "none"
        want = huginn_generate(
            model,
            prompt,
            max_tokens=6,
            seed=seed,
            lookup=lookup,
            exit_criterion=criterion,
            exit_threshold=threshold or None,
        )
        assert_matches_oracle(output.outputs[0], want, len(prompt), atol=2e-3)
    assert llm.engine.all_blocks_free()


@pytest.mark.long
def test_cuda_huginn_runs_in_bf16_with_graphs(folder):
    llm = _llm(folder, "auto", True, "last_exited", "auto", dtype="bfloat16")
    params = SamplingParams(max_tokens=8, temperature=0.0, seed=1, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outputs)
    assert llm.engine.runner.num_decode_graph_passes > 0
    assert torch.cuda.is_available()


@pytest.mark.long
def test_cuda_huginn_at_head_size_96_equals_the_oracle_on_triton(tmp_path, exact_float32):
    """Huginn-0125's head size (96, no power of two) on the Triton kernels' masked lanes,
    with graphs, at a fixed depth and under the latent criterion."""
    write_tiny_huginn(
        tmp_path, seed=5, overrides={"n_embd": 192, "n_heads": 2, "num_key_value_heads": 2}
    )
    model = HuginnModel.from_folder(tmp_path)
    assert model.cfg.head_dim == 96
    for layout, lookup, threshold in (("last_exited", "latest", 0.0), ("shared", "final", 0.5)):
        llm = _llm(tmp_path, "triton", True, layout, "latent_diff")
        assert llm.engine.runner.ops.__class__.__name__ == "TritonOps"
        _check(llm, model, lookup, threshold)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [3, 1024, 5280])
def test_initial_state_kernel_draws_the_torch_bits(dtype, width):
    """The Triton draw equals the torch ops' draw bit for bit, for negative and 63-bit
    seeds, positions past 2^32, widths below, at and past a block, no rows, and a std
    whose float64 bits would pass as a 32-bit integer."""
    from vllm_rlt.kernels.truncated_normal import truncated_normal_cuda
    from vllm_rlt.layers.initial_state import truncated_normal

    seeds = torch.tensor([0, 7, -5, 2**62 + 3, -(2**63)], device="cuda")
    positions = torch.tensor([0, 1, 99_999, 2**33 + 5, 17], device="cuda")
    for rows, std in ((5, 0.0194), (0, 0.0194), (5, 1e-320)):  # 1e-320: subnormal
        args = (seeds[:rows], positions[:rows], width, std, 72.66, dtype)
        got, want = truncated_normal_cuda(*args), truncated_normal(*args)
        assert got.dtype == dtype and got.shape == (rows, width)
        assert torch.equal(got, want), (got.float() - want.float()).abs().max()
