"""A layer's budget (bench/layer_budget.py): bounds against hand-computed figures at the
Ouro-1.4B shape; the kernels of a profiled pass split into its ops (bench/budget_report.py);
and `python -m benchmarks.profile_pass --budget --bounds-only` on the CPU."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from benchmarks.profile_pass import main
from vllm_rlt.bench import layer_budget
from vllm_rlt.bench.budget_report import (
    ADD_NORMS,
    AFTER,
    BEFORE,
    KERNEL_KINDS,
    NORM,
    OTHER,
    OUTSIDE,
    PRODUCT,
    Measured,
    attribute,
    budget_record,
    fold,
    kernel_kind,
    marginal_us,
    print_budget,
)
from vllm_rlt.bench.layer_budget import (
    ATTENTION,
    ATTENTION_NORMS,
    DOWN,
    FP8_SKINNY_ROWS,
    GATE_UP,
    INPUT_NORM,
    MLP_NORMS,
    O_PROJ,
    QKV,
    ROPE,
    ROPE_ATTENTION,
    Device,
    LayerShape,
    layer_bound_us,
    layer_ops,
)
from vllm_rlt.bench.shapes import SHAPES

PACKAGE = Path(layer_budget.__file__).parents[1]
OURO = LayerShape.from_config(SHAPES["ouro-1.4b"]())
# Ouro-1.4B's projections: (N, K, columns written), gate_up writing its SiLU-mul's half.
PROJECTIONS = {
    QKV: (6144, 2048, 6144),
    O_PROJ: (2048, 2048, 2048),
    GATE_UP: (11264, 2048, 5632),
    DOWN: (2048, 5632, 2048),
}


def ops_by_name(*args, **kwargs) -> dict:
    return {op.name: op for op in layer_ops(*args, **kwargs)}


def test_the_ouro_shape_is_read_from_its_config():
    assert OURO == LayerShape(2048, 5632, 16, 16, 128, 24, 49152, branch_norms=True)
    nanbeige = LayerShape.from_config(SHAPES["nanbeige-4.2-3b"](), branch_norms=False)
    assert (nanbeige.heads, nanbeige.kv_heads, nanbeige.head_dim) == (48, 8, 128)


def test_one_row_in_bf16_is_the_hand_computed_budget():
    ops = layer_ops(OURO, 1, "bf16", kv_bytes=2, context=64)
    assert [op.name for op in ops] == [
        QKV,
        ROPE_ATTENTION,
        O_PROJ,
        ATTENTION_NORMS,
        GATE_UP,
        DOWN,
        MLP_NORMS,
    ]
    by_name = {op.name: op for op in ops}
    weights = sum(by_name[name].bytes - (k + out) * 2 for name, (_, k, out) in PROJECTIONS.items())
    assert weights == ((6144 + 2048 + 11264) * 2048 + 2048 * 5632) * 2 == 102_760_448
    assert by_name[QKV].bytes == 6144 * 2048 * 2 + (2048 + 6144) * 2
    assert by_name[QKV].flops == 2 * 6144 * 2048
    # q, k, v in; q, K and V out; q in, 64 positions of K and V, the output
    assert by_name[ROPE_ATTENTION].bytes == (6144 + 2048) * 2 + 2 * 2048 * 2 + (
        2 * 2048 * 2 + 64 * 2 * 2048 * 2
    )
    assert by_name[ROPE_ATTENTION].flops == 4 * 16 * 128 * 64
    # x and the branch in, x and its norm out, the branch's and the next norm's weights
    assert by_name[ATTENTION_NORMS].bytes == 4 * 2048 * 2 + 2 * 2048 * 2
    device = Device()
    assert by_name[QKV].bytes_us(device) == pytest.approx(25_182_208 / 4.3e12 * 1e6)
    assert all(op.limit(device) == "bytes" for op in ops)
    total = sum(op.bytes for op in ops)
    assert layer_bound_us(ops, device) == pytest.approx(total / 4.3e6)
    assert layer_bound_us(ops, device) == pytest.approx(24.05, abs=0.01)


@pytest.mark.parametrize("rows", [1, 64])
def test_fp8_halves_the_projection_weights_and_adds_their_row_scales(rows):
    bf16, fp8 = ops_by_name(OURO, rows, "bf16"), ops_by_name(OURO, rows, "fp8")
    for name, (n, k, out) in PROJECTIONS.items():
        activations = rows * (k + out) * 2
        assert bf16[name].bytes == 2 * n * k + activations
        assert fp8[name].bytes == n * k + 4 * n + activations
        assert fp8[name].flops == bf16[name].flops
    for name in set(bf16) - set(PROJECTIONS):
        assert fp8[name] == bf16[name]


def test_fp8_products_count_at_the_fp8_rate_only_where_fp8_tensor_cores_run_them():
    device = Device(bandwidth=1e12, bf16_flops=1e14, fp8_flops=3e14)
    few = ops_by_name(OURO, FP8_SKINNY_ROWS, "fp8")
    many = ops_by_name(OURO, FP8_SKINNY_ROWS + 1, "fp8")
    assert not any(few[name].fp8 for name in PROJECTIONS)
    assert all(many[name].fp8 for name in PROJECTIONS)
    assert not any(op.fp8 for op in layer_ops(OURO, 512, "bf16"))
    rows = FP8_SKINNY_ROWS
    flops = 2 * 11264 * 2048
    assert many[GATE_UP].flops_us(device) == pytest.approx((rows + 1) * flops / 3e14 * 1e6)
    assert few[GATE_UP].flops_us(device) == pytest.approx(rows * flops / 1e14 * 1e6)


def test_many_rows_in_bf16_are_bound_by_flops():
    device = Device()
    gate_up = ops_by_name(OURO, 512, "bf16")[GATE_UP]
    flops_us = 2 * 512 * 11264 * 2048 / 7.9e14 * 1e6
    bytes_us = (11264 * 2048 * 2 + 512 * (2048 + 5632) * 2) / 4.3e12 * 1e6
    assert gate_up.flops_us(device) == pytest.approx(flops_us)
    assert gate_up.bytes_us(device) == pytest.approx(bytes_us)
    assert gate_up.limit(device) == "FLOPs" and gate_up.bound_us(device) == pytest.approx(flops_us)
    assert ops_by_name(OURO, 1, "bf16")[GATE_UP].limit(device) == "bytes"


def test_attention_reads_grow_with_the_context_and_the_rows():
    def attention(rows, context, kv_bytes=2):
        return ops_by_name(OURO, rows, "bf16", kv_bytes=kv_bytes, context=context)[ATTENTION]

    per_position = 2 * 16 * 128 * 2  # K and V of 16 heads of 128 in bf16
    assert attention(64, 128).bytes - attention(64, 64).bytes == 64 * 64 * per_position
    assert attention(128, 64).bytes == 2 * attention(64, 64).bytes
    assert attention(64, 64).bytes - attention(64, 64, kv_bytes=1).bytes == 64 * 64 * (
        per_position // 2
    )
    assert attention(64, 128).flops == 4 * 64 * 16 * 128 * 128


def test_rope_and_attention_merge_where_one_kernel_runs_both():
    few, many = ops_by_name(OURO, 16, "bf16"), ops_by_name(OURO, 17, "bf16")
    assert ROPE_ATTENTION in few and ROPE not in few and ATTENTION not in few
    assert ROPE in many and ATTENTION in many and ROPE_ATTENTION not in many
    rope = 16 * (6144 + 2048) * 2 + 16 * 2 * 2048 * 2
    attention = 16 * (2 * 2048 * 2 + 64 * 2 * 2048 * 2)
    assert few[ROPE_ATTENTION].bytes == rope + attention
    assert many[ROPE].bytes == 17 * rope // 16 and many[ATTENTION].bytes == 17 * attention // 16


def _module_constants(name: str) -> dict:
    """The constants a module of the ops package assigns, read from its source (the module
    needs triton to import)."""
    source = (PACKAGE / "ops" / name).read_text()
    return {
        target.id: node.value.value
        for node in ast.parse(source).body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        for target in node.targets
        if isinstance(target, ast.Name)
    }


def test_the_engine_constants_the_bounds_follow_are_the_backends():
    plans, launches = _module_constants("linear_plans.py"), _module_constants("triton_ops.py")
    assert plans["FP8_SKINNY_ROWS"] == layer_budget.FP8_SKINNY_ROWS
    assert launches["FUSED_DECODE_ROWS"] == layer_budget.FUSED_DECODE_ROWS


def test_a_model_without_branch_norms_reads_one_norm_weight_per_add():
    shape = LayerShape.from_config(SHAPES["ouro-1.4b"](), branch_norms=False)
    assert ops_by_name(shape, 1)[ATTENTION_NORMS].bytes == 4 * 2048 * 2 + 2048 * 2


@pytest.mark.parametrize(
    "name, kind",
    [
        ("_rope_attend_kernel", ROPE_ATTENTION),
        ("_rope_write_kernel", ROPE),
        ("_rope_write_rows_kernel", ROPE),
        ("_paged_attention_kernel", ATTENTION),
        ("_combine_splits_kernel", ATTENTION),
        ("paged_decode_d128_bf16_g1", ATTENTION),
        ("paged_decode_d96_e4m3_g8", ATTENTION),
        ("_add_rms_norm2_kernel", ADD_NORMS),
        ("_rms_norm_kernel", NORM),
        ("_quantize_rows_kernel", BEFORE),
        ("_silu_mul_kernel", AFTER),
        ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>", AFTER),
        ("_skinny_linear_kernel", PRODUCT),
        ("_strip_gemv_kernel", PRODUCT),
        ("_w8a8_kernel", PRODUCT),
        ("w8a16_n16_silu", PRODUCT),
        ("w16a16_n8", PRODUCT),
        ("nvjet_tst_128x64_64x6_1x1_h_bz_NNT", PRODUCT),
        ("sm90_xmma_gemm_e4m3bf16_bf16f32_f32_tn_n_tilesize128x128x64_cublas", PRODUCT),
        ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64>", PRODUCT),
        ("void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128>", PRODUCT),
        ("void at::native::vectorized_elementwise_kernel<4, FillFunctor<BFloat16>>", OTHER),
        ("Memcpy HtoD (Pageable -> Device)", OTHER),
        ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", OTHER),
    ],
)
def test_kernel_names_map_to_the_part_they_play(name, kind):
    assert kernel_kind(name) == kind


def test_the_triton_kernel_names_matched_are_the_kernels():
    sources = "".join(path.read_text() for path in (PACKAGE / "kernels").rglob("*.*"))
    for part, _ in KERNEL_KINDS:
        if part.startswith("_"):
            assert re.search(rf"\b{part}\w*\(", sources), part
        elif part.startswith(("w8a16", "w16a16")):  # CUDA: FEW_ROW_KERNEL(name, ...)
            assert re.search(rf"KERNEL\({part}\w*,", sources), part
        elif part.startswith("paged_decode"):  # CUDA: paged_decode_d##D##_##NAME##_g##G
            assert re.search(rf"\b{part}##D##_##NAME##_g##G\(", sources), part


def one_pass(layer: list[str], layers: int = 2) -> list[str]:
    """A decode pass's kernels: embedding, the input norm, the layers, then the head."""
    head = ["_skinny_linear_kernel", "gemv2T_kernel_val", "reduce_kernel", "Memcpy DtoH"]
    return ["Memcpy HtoD", "index_select_kernel", "_rms_norm_kernel", *layer * layers, *head]


def timed(names: list[str]) -> list[tuple[str, float]]:
    return [(name, float(i % 5 + 1)) for i, name in enumerate(names)]


def test_a_few_row_pass_splits_into_its_layers_ops():
    layer = ["_skinny_linear_kernel", "_rope_attend_kernel", "_combine_splits_kernel"]
    layer += ["_skinny_linear_kernel", "_add_rms_norm2_kernel", "_strip_gemv_kernel"]
    layer += ["_skinny_linear_kernel", "_add_rms_norm2_kernel"]
    spent = attribute([(name, 1.0) for name in one_pass(layer) * 3], layers_per_pass=2)
    assert (spent.layers, spent.passes, spent.irregular) == (6, 3, 0)
    assert spent.layer == {
        QKV: 1.0,
        ROPE_ATTENTION: 1.0,
        ATTENTION: 1.0,
        O_PROJ: 1.0,
        ATTENTION_NORMS: 1.0,
        GATE_UP: 1.0,
        DOWN: 1.0,
        MLP_NORMS: 1.0,
    }
    assert spent.per_pass == {INPUT_NORM: 1.0, OUTSIDE: 6.0}
    assert fold(spent.layer, [op.name for op in layer_ops(OURO, 1)])[ROPE_ATTENTION] == 2.0


def test_a_many_row_fp8_pass_gives_each_projection_its_quantize_and_epilogue():
    gemm = "sm90_xmma_gemm_e4m3bf16"
    layer = ["_quantize_rows_kernel", gemm, "_rope_write_rows_kernel"]
    layer += ["_paged_attention_kernel", "_quantize_rows_kernel", gemm, "_add_rms_norm2_kernel"]
    layer += ["_quantize_rows_kernel", gemm, "_silu_mul_kernel", "_quantize_rows_kernel", gemm]
    layer += ["splitKreduce_kernel", "vectorized_elementwise_kernel", "_add_rms_norm2_kernel"]
    kernels = timed(one_pass(layer, layers=1))
    spent = attribute(kernels, layers_per_pass=1)
    us = dict(enumerate(t for _, t in kernels))
    first = 3  # the layer's first kernel, after the embedding and the input norm
    assert (spent.layers, spent.passes, spent.irregular) == (1, 1, 0)
    assert spent.layer == {
        QKV: us[first] + us[first + 1],
        ROPE: us[first + 2],
        ATTENTION: us[first + 3],
        O_PROJ: us[first + 4] + us[first + 5],
        ATTENTION_NORMS: us[first + 6],
        GATE_UP: us[first + 7] + us[first + 8] + us[first + 9],
        DOWN: us[first + 10] + us[first + 11] + us[first + 12],
        OTHER: us[first + 13],
        MLP_NORMS: us[first + 14],
    }
    assert sum(spent.layer.values()) + sum(spent.per_pass.values()) == sum(us.values())


def test_a_layer_without_four_products_is_counted_irregular():
    layer = ["_skinny_linear_kernel", "_rope_attend_kernel", "some_new_gemm_kernel_name"]
    layer += ["_add_rms_norm2_kernel", "mystery_kernel", "_add_rms_norm2_kernel"]
    spent = attribute([(name, 1.0) for name in one_pass(layer)], layers_per_pass=2)
    assert (spent.layers, spent.irregular) == (2, 2)
    assert spent.layer[OTHER] == 1.0 and DOWN not in spent.layer


def test_each_kernel_counts_only_the_time_it_adds_to_the_stream():
    kernels = [("c", 20.0, 22.0), ("a", 0.0, 10.0), ("b", 8.0, 15.0), ("inside", 9.0, 12.0)]
    assert marginal_us(kernels) == [("a", 10.0), ("b", 5.0), ("inside", 0.0), ("c", 2.0)]


def test_unknown_measured_ops_fold_into_other():
    measured = {ROPE_ATTENTION: 5.0, ATTENTION: 2.0, QKV: 1.0, "mystery": 3.0}
    assert fold(measured, [QKV, ROPE_ATTENTION]) == {QKV: 1.0, ROPE_ATTENTION: 7.0, OTHER: 3.0}


def test_a_measured_budget_prints_each_op_against_its_bound(capsys):
    layer = ["_skinny_linear_kernel", "_rope_attend_kernel", "_skinny_linear_kernel"]
    layer += ["_add_rms_norm2_kernel", "_skinny_linear_kernel", "_skinny_linear_kernel"]
    layer += ["fill_kernel", "_add_rms_norm2_kernel"]
    spent = attribute([(name, 3.0) for name in one_pass(layer, layers=24)], 24)
    measured = Measured(context=70, host_ms=0.2, device_ms=1.4, kernels=spent)
    record = budget_record("ouro-1.4b", OURO, 8, "bf16", "auto", 64, Device(), measured)
    print_budget(record)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("ouro-1.4b, 8 rows, bf16 weights, bf16 K/V, 70 positions a row")
    assert json.loads(lines[-1]) == record
    assert record["context"] == 70 and record["layer_measured_us"] == 24.0
    assert record["other_us"] == 3.0 and record["irregular_layers"] == 0
    qkv = record["ops"][0]
    assert qkv["op"] == QKV and qkv["measured_us"] == 3.0
    table = {line.split("  ")[0]: line for line in lines if line.startswith(("qkv", "other"))}
    assert table[QKV].split()[-2:] == ["3.00", f"{3.0 / qkv['bound_us']:.2f}"]
    assert table[OTHER].split()[-1] == "3.00"
    assert any(line.startswith("measured a pass: 1400.0 us on the device") for line in lines)
    assert not any(line.startswith("warning") for line in lines)


def budget_records(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_bounds_only_prints_a_table_per_row_count_and_dtype_without_a_gpu(capsys):
    main(["--budget", "--bounds-only"])
    out = capsys.readouterr().out
    assert "bounds at HBM 4.3e+12 B/s, bf16 tensor cores 7.9e+14 FLOP/s, fp8 1.58e+15" in out
    records = budget_records(out)
    cases = [(r["weights"], r["rows"]) for r in records]
    assert cases == [(w, rows) for w in ("bf16", "fp8") for rows in (1, 8, 64, 256, 512)]
    for weights, rows in cases:
        title = f"ouro-1.4b, {rows} row{'s' if rows > 1 else ''}, {weights} weights, bf16 K/V"
        assert title in out
    assert records[0]["layer_bound_us"] == pytest.approx(24.05, abs=0.01)
    assert "measured" not in out and all("measured_us" not in op for op in records[0]["ops"])


def test_bounds_only_follows_the_quantization_rows_and_rates(capsys):
    argv = ["--bounds-only", "--quantization", "fp8", "--rows", "8", "--prompt-len", "128"]
    main(argv + ["--kv-cache-dtype", "fp8", "--bandwidth", "2e12", "--bf16-flops", "1e15"])
    (record,) = budget_records(capsys.readouterr().out)
    assert (record["weights"], record["rows"], record["context"]) == ("fp8", 8, 128)
    assert (record["bandwidth"], record["fp8_flops"]) == (2e12, 2e15)
    ops = layer_ops(OURO, 8, "fp8", kv_bytes=1, context=128)
    assert record["layer_bound_us"] == pytest.approx(sum(op.bytes for op in ops) / 2e6, abs=1e-3)


def test_a_measured_budget_divides_by_the_cards_own_bandwidth(capsys, monkeypatch):
    """Without --bandwidth the bounds take the copy bandwidth measured on the GPU (here a
    stand-in figure; the measurement itself is stubbed, as is the profile)."""
    import benchmarks.profile_pass as tool

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr(tool, "copy_bandwidth", lambda device: 3.0e12)
    monkeypatch.setattr(tool, "measure_budget", lambda *args: {})
    monkeypatch.setattr("torch.cuda.empty_cache", lambda: None)
    main(["--budget", "--rows", "8"])
    out = capsys.readouterr().out
    assert "bounds at HBM 3e+12 B/s" in out
    assert {r["bandwidth"] for r in budget_records(out)} == {3.0e12}


def test_the_help_shows_the_budgets_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    flat = " ".join(capsys.readouterr().out.split())
    shown = ("copy bandwidth, measured; with --bounds-only 4.3e+12", "(default: 7.9e+14")
    for text in (*shown, "(default: twice --bf16-flops)"):
        assert text in flat
    assert "--budget: 1 8 64 256 512" in flat


def test_measuring_the_budget_without_cuda_fails_in_one_line(capsys, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        main(["--budget"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--bounds-only" in err


def test_the_budget_of_a_family_it_does_not_model_is_a_one_line_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--budget", "--bounds-only", "--shape", "huginn-3.5b"])
    assert exit_info.value.code == 2
    assert "not huginn-3.5b's" in capsys.readouterr().err


def test_sources_rank_kernels_by_the_innermost_package_frame_of_their_launcher():
    from types import SimpleNamespace

    from benchmarks.profile_pass import device_time_by_source

    def event(name, stack=(), parent=None, kernels=()):
        kernels = [SimpleNamespace(duration=us) for us in kernels]
        return SimpleNamespace(name=name, stack=list(stack), cpu_parent=parent, kernels=kernels)

    huginn = "vllm_rlt/models/huginn.py(266): _layer"
    step = event("step", ["vllm_rlt/worker/model_runner.py(300): execute"])
    silu = event("aten::silu", ["torch/nn/functional.py(2000): silu", huginn, "runner"], step)
    launch = event("cuLaunchKernel", [], parent=step, kernels=[7.0])  # its parent's frame
    events = [step, silu, event("aten::silu", [], silu, [2.0, 1.0]), launch]
    frame = event("vllm_rlt/exit/latent_diff.py(40): decide", parent=step)  # a Python event
    events.append(event("aten::norm", [], event("<built-in method norm>", [], frame), [4.0]))
    events.append(event("cudaMemsetAsync", kernels=[0.5]))  # no frame anywhere: its name

    # no parent links, but Python-function events on its thread whose spans hold it: the
    # innermost (latest-starting) one that holds it all
    def timed(name, thread, start, end, kernels=()):
        found = event(name, kernels=kernels)
        found.thread, found.time_range = thread, SimpleNamespace(start=start, end=end)
        return found

    outer = "vllm_rlt/layers/initial_state.py(30): truncated_normal"
    inner = "vllm_rlt/layers/sampler.py(104): seeded_uniform"
    events += [timed(outer, 1, 0, 100), timed(inner, 1, 10, 20), timed(inner, 2, 30, 90)]
    held = "vllm_rlt/layers/sampler.py(90): _mix32"  # starts with its caller: still inner
    events += [timed(held, 1, 60, 70), timed(outer, 1, 60, 100)]
    events += [timed("aten::rshift", 1, 61, 62, [0.5])]
    events += [timed("aten::bitwise_xor", 1, 40, 50, [1.5]), timed("aten::mul", 1, 12, 15, [2.5])]
    assert device_time_by_source(events) == {
        huginn: (3.0, 2),
        "vllm_rlt/worker/model_runner.py(300): execute": (7.0, 1),
        "(cudaMemsetAsync)": (0.5, 1),
        "vllm_rlt/exit/latent_diff.py(40): decide": (4.0, 1),
        outer: (1.5, 1),
        inner: (2.5, 1),
        held: (0.5, 1),
    }
