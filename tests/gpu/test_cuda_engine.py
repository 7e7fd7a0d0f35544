"""The engine on CUDA (torch attention backend) against the CPU oracle and the CPU engine."""

from __future__ import annotations

import random

import pytest
import torch

from tests.conftest import drain, frontend
from tests.e2e.test_engine_vs_oracle import MAX_TOKENS, POLICIES, _oracle, _prompts, _traces
from vllm_rlt import CacheConfig, ExecutionConfig, ExitConfig, SamplingParams, SchedulerConfig
from vllm_rlt.engine.builder import build_engine_core
from vllm_rlt.engine_config import DeviceConfig, EngineConfig, ModelConfig
from vllm_rlt.layers.sampler import SamplingMode
from vllm_rlt.models.ouro import OuroConfig, OuroModel
from vllm_rlt.tokenizer import Tokenizer

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("exact_float32")]


def _cuda_engine(
    toy_config,
    toy_state,
    dtype,
    layout,
    policy,
    mode,
    backend="torch",
    graphs=False,
    async_scheduling=False,
    speculative_config=None,
):
    exit_mode, _ = POLICIES[policy]
    model = OuroModel(OuroConfig.from_dict(toy_config), toy_state, dtype, "cuda")
    return build_engine_core(
        model,
        Tokenizer.byte_level(),
        EngineConfig(
            cache_config=CacheConfig(layout=layout, num_blocks=128, block_size=4),
            scheduler_config=SchedulerConfig(
                mode=mode, prefill_chunk_size=4, max_num_seqs=4, max_num_batched_tokens=64
            ),
            exit_config=ExitConfig(
                mode=exit_mode, depths_by_request=_traces() if exit_mode == "trace" else {}
            ),
            execution_config=ExecutionConfig(cuda_graphs=graphs, async_scheduling=async_scheduling),
            speculative_config=speculative_config,
            device_config=DeviceConfig(attention_backend=backend),
        ),
    )


def _fast_fixed_depth_engine(toy_config, toy_state, speculative_config=None):
    """float32, last_exited, depth 4 (ouro q = 1.0), triton with graphs and async."""
    return _cuda_engine(
        toy_config,
        toy_state,
        torch.float32,
        "last_exited",
        "ouro_q1.0",
        "refill",
        "triton",
        graphs=True,
        async_scheduling=True,
        speculative_config=speculative_config,
    )


def _run(engine, policy):
    _, threshold = POLICIES[policy]
    arrivals = {
        step: [
            (
                f"r{i}",
                prompt,
                SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0.0, exit_threshold=threshold),
            )
        ]
        for i, (step, prompt) in enumerate(zip((0, 1, 3, 17), _prompts(), strict=True))
    }
    outputs = drain(engine, arrivals)
    assert engine.all_blocks_free()
    return outputs


BACKENDS = [
    ("torch", False, False),
    ("triton", False, False),
    ("triton", True, False),
    ("triton", True, True),
]


@pytest.mark.long
@pytest.mark.parametrize(
    ("backend", "graphs", "async_scheduling"), BACKENDS, ids=["torch", "triton", "graphs", "async"]
)
@pytest.mark.parametrize("mode", ["refill", "no_refill"])
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("layout", ["last_exited", "shared", "shared_decode"])
def test_cuda_float32_matches_oracle(
    toy_config, toy_state, layout, policy, mode, backend, graphs, async_scheduling
):
    expected = _oracle(toy_config, toy_state, layout, policy)
    engine = _cuda_engine(
        toy_config,
        toy_state,
        torch.float32,
        layout,
        policy,
        mode,
        backend,
        graphs,
        async_scheduling,
    )
    outputs = _run(engine, policy)
    for i, reference in enumerate(expected):
        completion = outputs[f"r{i}"].outputs[0]
        assert completion.token_ids == reference.token_ids
        assert completion.exit_depths == reference.exit_depths


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["last_exited", "shared", "shared_decode"])
def test_graphs_equal_eager_with_sampling(toy_config, toy_state, dtype, layout):
    """Same kernels, replayed or launched, synchronously or not: identical tokens, depths
    and logprobs, also for seeded sampling with logprobs."""
    params = SamplingParams(
        max_tokens=12, temperature=0.9, top_k=20, top_p=0.9, seed=3, logprobs=3, exit_threshold=0.6
    )
    results = []
    for graphs, async_scheduling in ((False, False), (True, False), (True, True)):
        engine = _cuda_engine(
            toy_config,
            toy_state,
            dtype,
            layout,
            "ouro_q0.7",
            "refill",
            "triton",
            graphs,
            async_scheduling,
        )
        arrivals = {i: [(f"s{i}", prompt, params)] for i, prompt in enumerate(_prompts())}
        outputs = drain(engine, arrivals)
        assert engine.all_blocks_free()
        stats = engine.stats()
        if graphs:  # staggered arrivals: passes with prompt rows ran as captured graphs
            assert engine.runner.mixed.num_replays == stats.num_prompt_graph_passes > 0
            assert 0 < stats.num_decode_graph_passes < stats.num_passes
        else:
            assert stats.num_prompt_graph_passes == stats.num_decode_graph_passes == 0
        results.append(
            {
                rid: (o.outputs[0].token_ids, o.outputs[0].exit_depths, o.outputs[0].logprobs)
                for rid, o in outputs.items()
            }
        )
    # Tokens and depths must match exactly. Logprob values may differ in the last bits:
    # asynchronous scheduling keeps a just-finished request's row for one more pass, which can
    # move the pass to another padded batch size and so to another GEMM kernel.
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for other in results[1:]:
        assert other.keys() == results[0].keys()
        for rid, (tokens, depths, logprobs) in other.items():
            want_tokens, want_depths, want_logprobs = results[0][rid]
            assert (tokens, depths) == (want_tokens, want_depths)
            for token, got, want in zip(tokens, logprobs, want_logprobs, strict=True):
                # Near-tied alternatives may swap places, so compare the values in order.
                assert got[token].logprob == pytest.approx(want[token].logprob, abs=tolerance)
                # The top 3 by value (the sampled token joins them as a 4th when it is not
                # among them, which a near tie in bf16 may decide either way).
                top = [
                    sorted((v.logprob for v in d.values()), reverse=True)[:3] for d in (got, want)
                ]
                assert top[0] == pytest.approx(top[1], abs=tolerance)


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "lanes"])
def test_decode_pass_has_no_hidden_host_sync(toy_config, toy_state, speculative):
    """A decode-only pass, eager and replayed, under sync debug mode "error"; with
    speculation, a sampled pass of lanes (drafts, acceptance and restarts on the device)."""
    from vllm_rlt import SpeculativeConfig

    spec = SpeculativeConfig(num_speculative_tokens=3, draft_loops=2) if speculative else None
    engine = _cuda_engine(
        toy_config,
        toy_state,
        torch.bfloat16,
        "last_exited",
        "ouro_q0.7",
        "refill",
        "triton",
        True,
        speculative_config=spec,
    )
    threshold, temperature = (1.0, 1.0) if speculative else (0.5, 0.0)
    for i, prompt in enumerate(_prompts()):
        frontend(engine).add_request(
            f"r{i}",
            prompt,
            SamplingParams(max_tokens=20, temperature=temperature, exit_threshold=threshold),
        )
    scheduler = engine.scheduler
    while scheduler.waiting or any(r.status.value != "decode" for r in scheduler.running.values()):
        frontend(engine).step()
    frontend(engine).step()  # one decode pass (a replay) first: later passes are the steady state
    runner = engine.runner
    rows = scheduler.schedule().decode_slots
    assert rows
    slots = torch.tensor(rows, dtype=torch.int64, device="cuda")
    mode = SamplingMode.PLAIN if speculative else SamplingMode.GREEDY
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        runner.run_pass(slots, (), 0, mode, 0, False, speculative)
        key = next(k for k in runner.graphs.graphs if k[1] == mode and k[4] == speculative)
        runner.graphs.graphs[key][0].replay()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    for request_id in list(engine.groups):  # the manual passes moved device state on
        frontend(engine).abort_request(request_id)
    assert engine.all_blocks_free()


def test_mixed_pass_launches_no_kernel_outside_its_graphs(toy_config, toy_state):
    """A pass with decode rows and a prompt chunk, under the profiler: graph launches and
    copies only. The same count finds the kernels of an eager pass, so the check can fail."""
    from torch.profiler import ProfilerActivity, profile

    engine = _cuda_engine(
        toy_config, toy_state, torch.bfloat16, "last_exited", "ouro_q0.7", "refill", "triton", True
    )
    front, runner = frontend(engine), engine.runner
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, exit_threshold=0.5)
    front.add_request("a", _prompts()[0], params)
    scheduler = engine.scheduler
    while scheduler.waiting or any(r.status.value != "decode" for r in scheduler.running.values()):
        front.step()
    front.add_request("b", _prompts()[1], params)
    out = engine.scheduler.schedule()
    assert out.decode_slots and out.prefill_chunks and runner.mixed.takes(out)
    for _, error in runner.admit(out.new_slots):
        raise error

    def launches(run) -> tuple[int, int]:
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        names = [event.name for event in prof.events()]
        return sum("LaunchKernel" in n for n in names), sum("GraphLaunch" in n for n in names)

    replays = runner.mixed.num_replays
    pending: list = []
    kernels, graphs = launches(lambda: pending.append(runner.launch(out)))
    runner.collect(pending[0])
    assert runner.mixed.num_replays == replays + 1
    assert kernels == 0 and graphs > 0
    decode = torch.tensor(out.decode_slots, dtype=torch.int64, device="cuda")
    eager, _ = launches(lambda: runner.run_pass(decode, (), 0, SamplingMode.GREEDY, 0))
    assert eager > 0
    for request_id in list(engine.groups):  # the manual passes moved device state on
        front.abort_request(request_id)
    assert engine.all_blocks_free()


def test_prompts_finishing_together_stay_in_graphs(toy_config, toy_state):
    """40 prompts of one length arrive together, so 40 sample in one pass: more than the
    smallest sampler padding (32). Every pass still runs as captured graphs, with the
    tokens and depths of eager passes."""
    from vllm_rlt.worker.mixed_graphs import PROMPT_SAMPLER_SIZES

    rng = random.Random(5)
    prompts = [[rng.randrange(3, 259) for _ in range(8)] for _ in range(40)]
    assert len(prompts) > PROMPT_SAMPLER_SIZES[0]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, exit_threshold=0.7)
    results = []
    for graphs in (False, True):
        model = OuroModel(OuroConfig.from_dict(toy_config), toy_state, torch.float32, "cuda")
        engine = build_engine_core(
            model,
            Tokenizer.byte_level(),
            EngineConfig(
                cache_config=CacheConfig(num_blocks=512, block_size=4),
                scheduler_config=SchedulerConfig(
                    max_num_seqs=48, max_num_batched_tokens=512, prefill_chunk_size=16
                ),
                exit_config=ExitConfig(mode="ouro"),
                execution_config=ExecutionConfig(cuda_graphs=graphs),
                device_config=DeviceConfig(attention_backend="triton"),
            ),
        )
        arrivals = {0: [(f"p{i}", prompt, params) for i, prompt in enumerate(prompts)]}
        outputs = drain(engine, arrivals)
        assert engine.all_blocks_free()
        stats = engine.stats()
        if graphs:
            assert stats.num_prompt_graph_passes > 0
            graphed = stats.num_prompt_graph_passes + stats.num_decode_graph_passes
            assert graphed == stats.num_passes  # no eager pass, the one of 40 samplers neither
        results.append(
            {rid: (o.outputs[0].token_ids, o.outputs[0].exit_depths) for rid, o in outputs.items()}
        )
    assert results[0] == results[1]


def test_cuda_bfloat16_runs_and_stays_close(toy_config, toy_state):
    """bf16 rounds differently, so its tokens are not compared with float32 here; every
    request must still finish with valid exit depths and free all blocks."""
    engine = _cuda_engine(
        toy_config, toy_state, torch.bfloat16, "last_exited", "ouro_q0.7", "refill"
    )
    outputs = _run(engine, "ouro_q0.7")
    for i in range(len(_prompts())):
        completion = outputs[f"r{i}"].outputs[0]
        assert completion.exit_depths[0] == 4
        assert all(1 <= d <= 4 for d in completion.exit_depths)
        assert len(completion.token_ids) <= MAX_TOKENS[i]


def test_automatic_kv_sizing_honours_the_budget(toy_config, toy_state):
    """No explicit size: profile a maximum pass and fill the budget, capped at useful blocks."""
    model = OuroModel(OuroConfig.from_dict(toy_config), toy_state, torch.bfloat16, "cuda")

    def build(max_model_len: int | None = None):
        return build_engine_core(
            model,
            Tokenizer.byte_level(),
            EngineConfig(
                cache_config=CacheConfig(gpu_memory_utilization=0.5),
                scheduler_config=SchedulerConfig(max_num_seqs=8),
                device_config=DeviceConfig(attention_backend="triton"),
                model_config=ModelConfig(max_model_len=max_model_len),
            ),
        )

    engine = build()
    plan = engine.memory_plan
    assert plan.source == "gpu_profile" and plan.num_blocks > 0
    budget = plan.details["budget_bytes"]
    assert torch.cuda.memory_allocated() <= budget
    per_seq = -(-engine.max_model_len // plan.block_size)
    assert plan.num_blocks <= 8 * per_seq
    outputs = drain(engine, {0: [("a", _prompts()[1], SamplingParams(max_tokens=5))]})
    assert len(outputs["a"].outputs[0].token_ids) == 5 and engine.all_blocks_free()
    # max_model_len below the model's context caps the pool by what sequences can use.
    short = build(max_model_len=48)
    assert short.memory_plan.num_blocks == 8 * -(-48 // plan.block_size) < plan.num_blocks


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_prompt_logprobs_equal_dense_recompute(toy_config, toy_state, backend):
    """Prompt logprobs on the device (chunks of 4, graphs and async on for the triton
    backend) equal a dense float32 forward of the prompt, within 1e-4."""
    from tests.reference.oracle import reference_dense_logits

    fast = backend == "triton"
    engine = _cuda_engine(
        toy_config,
        toy_state,
        torch.float32,
        "last_exited",
        "ouro_q0.7",
        "refill",
        backend,
        graphs=fast,
        async_scheduling=fast,
    )
    prompt = _prompts()[3]
    params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=3)
    output = drain(engine, {0: [("p", prompt, params)]})["p"]
    dense = reference_dense_logits(toy_config, toy_state, prompt).log_softmax(-1)
    entries = output.prompt_logprobs
    assert entries is not None and entries[0] is None and len(entries) == len(prompt)
    for position in range(1, len(prompt)):
        row = dense[position - 1]
        for token_id, logprob in entries[position].items():
            assert logprob.logprob == pytest.approx(float(row[token_id]), abs=1e-4)
        assert set(torch.topk(row, 3).indices.tolist()) <= set(entries[position])
    assert engine.all_blocks_free()


@pytest.mark.parametrize("name", ["bias", "frequency", "all"])
def test_cuda_logit_adjustments_equal_the_reference(toy_config, toy_state, name):
    """Logit bias and penalties on the device, in CUDA graphs with async scheduling, next to
    a request without them: float32 greedy tokens equal the dense reference's."""
    from tests.e2e.test_sampling import ADJUSTMENTS, PROMPT, _reference_adjusted_greedy

    adjustments = ADJUSTMENTS[name]
    engine = _fast_fixed_depth_engine(toy_config, toy_state)
    params = SamplingParams(
        max_tokens=10, temperature=0.0, exit_threshold=1.0, ignore_eos=True, **adjustments
    )
    plain = SamplingParams(max_tokens=10, temperature=0.0, exit_threshold=1.0, ignore_eos=True)
    prompt = PROMPT + [65, 65]
    outputs = drain(engine, {0: [("adjusted", prompt, params), ("plain", prompt, plain)]})
    want = _reference_adjusted_greedy(toy_config, toy_state, prompt, 10, adjustments)
    assert outputs["adjusted"].outputs[0].token_ids == want
    assert outputs["plain"].outputs[0].token_ids == _reference_adjusted_greedy(
        toy_config, toy_state, prompt, 10, {}
    )
    assert engine.all_blocks_free()


def test_cuda_bad_words_equal_the_reference(toy_config, toy_state):
    """Bad words barred on the device, in CUDA graphs with async scheduling, next to a
    request without them: float32 greedy tokens equal the reference that bars them."""
    from tests.e2e.test_sampling import PROMPT, _reference_adjusted_greedy, _reference_without

    prompt = PROMPT + [65, 65]
    plain_tokens = _reference_adjusted_greedy(toy_config, toy_state, prompt, 10, {})
    words = [plain_tokens[2:4], [plain_tokens[6]]]
    engine = _fast_fixed_depth_engine(toy_config, toy_state)
    greedy = dict(max_tokens=10, temperature=0.0, exit_threshold=1.0, ignore_eos=True)
    params = SamplingParams(**greedy, bad_words_token_ids=words)
    outputs = drain(
        engine, {0: [("barred", prompt, params), ("plain", prompt, SamplingParams(**greedy))]}
    )
    assert outputs["barred"].outputs[0].token_ids == _reference_without(
        toy_config, toy_state, prompt, 10, words
    )
    assert outputs["plain"].outputs[0].token_ids == plain_tokens
    assert engine.all_blocks_free()


@pytest.mark.parametrize("policy", ["ouro_q1.0", "ouro_q0.7", "trace"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_speculation_equals_plain_greedy(toy_config, toy_state, backend, policy):
    """Self-speculation lanes on the device (graphs and async for the triton backend) give
    plain greedy decoding's tokens and exit depths, at a fixed depth and adaptive ones,
    with one-loop drafts (four lanes) and two-loop ones."""
    from vllm_rlt import SpeculativeConfig

    fast = backend == "triton"
    outputs = []
    for spec in (
        None,
        SpeculativeConfig(num_speculative_tokens=3, draft_loops=2),
        SpeculativeConfig(num_speculative_tokens=3, draft_loops=1),
    ):
        engine = _cuda_engine(
            toy_config,
            toy_state,
            torch.float32,
            "last_exited",
            policy,
            "refill",
            backend,
            graphs=fast,
            async_scheduling=fast,
            speculative_config=spec,
        )
        outputs.append(_run(engine, policy))
        if spec is not None:
            assert engine.scheduler.num_drafted > 0
    plain, *speculative = outputs
    for run in speculative:
        for rid, want in plain.items():
            got = run[rid].outputs[0]
            assert got.token_ids == want.outputs[0].token_ids, rid
            assert got.exit_depths == want.outputs[0].exit_depths, rid


def test_cuda_sampled_speculation_is_reproducible(toy_config, toy_state):
    """Rejection sampling on the device (graphs and async on): two runs with the same seeds
    give the same tokens, drafts are both accepted and refused, every block comes back."""
    from vllm_rlt import SpeculativeConfig

    runs = []
    for _ in range(2):
        engine = _fast_fixed_depth_engine(
            toy_config,
            toy_state,
            speculative_config=SpeculativeConfig(num_speculative_tokens=3, draft_loops=2),
        )
        params = SamplingParams(max_tokens=12, temperature=1.0, top_k=8, exit_threshold=1.0)
        arrivals = {
            0: [
                (f"s{seed}", _prompts()[seed % 4], replace_seed(params, seed)) for seed in range(16)
            ]
        }
        outputs = drain(engine, arrivals)
        scheduler = engine.scheduler
        assert 0 < scheduler.num_accepted < scheduler.num_drafted
        assert engine.all_blocks_free()
        runs.append({rid: o.outputs[0].token_ids for rid, o in outputs.items()})
    assert runs[0] == runs[1]
    assert all(len(tokens) == 12 or tokens[-1] in (0, 2) for tokens in runs[0].values())


def replace_seed(params: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, seed=seed)


def _compiled_variants(kernel) -> int:
    """Kernel variants Triton has compiled in this process (every device)."""
    return sum(len(caches[0]) for caches in kernel.device_caches.values())


def test_no_prompt_pass_compiles_after_start(toy_config, toy_state):
    """Start-up compiles the prompt attention kernel once; afterwards no prompt pass, of any
    tile count (odd ones once started a second variant) or size, compiles anything."""
    from vllm_rlt.kernels.prefill_attention import _prefill_attention_kernel

    engine = _fast_fixed_depth_engine(toy_config, toy_state)
    compiled = _compiled_variants(_prefill_attention_kernel)
    assert compiled >= 1
    arrivals = {
        0: [("one", [5] * 3, SamplingParams(max_tokens=2, temperature=0.0))],
        1: [(f"odd{i}", [7 + i] * 17, SamplingParams(max_tokens=2)) for i in range(3)],
        2: [(f"even{i}", [9 + i] * 33, SamplingParams(max_tokens=2)) for i in range(2)],
    }
    drain(engine, arrivals)
    assert engine.all_blocks_free()
    assert _compiled_variants(_prefill_attention_kernel) == compiled


def test_cuda_load_weights_in_place_keeps_graphs_valid(tmp_path):
    """load_weights on CUDA (graphs captured, async scheduling, bfloat16): greedy tokens
    become the second checkpoint's, as a fresh engine on it gives them."""
    from tests.unit.test_vllm_compat import _toy_folder
    from vllm_rlt import LLM
    from vllm_rlt.models.toy import toy_weights

    first = str(_toy_folder(tmp_path / "first", 1))
    second = str(_toy_folder(tmp_path / "second", 2))
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11]]

    def tokens(llm):
        return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]

    want = tokens(LLM(model=second, device="cuda", dtype="bfloat16"))
    llm = LLM(model=first, device="cuda", dtype="bfloat16")
    assert llm.engine.runner.graphs is not None
    assert tokens(llm) != want
    llm.load_weights(toy_weights(2).items())
    assert tokens(llm) == want


@pytest.mark.long
@pytest.mark.parametrize("level", [1, 2])
def test_cuda_sleep_gives_the_memory_back_and_wake_up_keeps_outputs(level):
    """Asleep, the device holds less by at least the KV pool (and the weights); awake (the
    graphs captured again), greedy outputs are those before sleep."""
    from vllm_rlt import LLM
    from vllm_rlt.models.toy import toy_weights

    llm = LLM(model="toy", device="cuda", dtype="bfloat16", enable_sleep_mode=True)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8] * 5, [9, 10, 11]]

    def tokens():
        return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]

    want = tokens()
    pool = sum(t.numel() * t.element_size() for t in llm.engine.runner.k_caches) * 2
    awake = torch.cuda.memory_allocated()
    llm.sleep(level=level)
    assert awake - torch.cuda.memory_allocated() >= pool
    llm.wake_up()
    assert llm.engine.runner.graphs is not None
    if level == 2:
        llm.load_weights(toy_weights().items())
    assert tokens() == want
    # In two steps: the weights first (then new ones could load), the pool and graphs after.
    llm.sleep(level=level)
    asleep = torch.cuda.memory_allocated()
    llm.wake_up(tags=["weights"])
    assert llm.engine.runner.graphs is None
    assert torch.cuda.memory_allocated() - asleep < pool  # the pool is still given back
    llm.load_weights(toy_weights().items())
    llm.wake_up(tags=["kv_cache"])
    assert llm.engine.runner.graphs is not None and tokens() == want
