"""Which layer op each kernel of a profiled decode pass served, and the layer budget's report."""

from __future__ import annotations

import json
from dataclasses import dataclass

from vllm_rlt.bench.layer_budget import (
    ATTENTION,
    ATTENTION_NORMS,
    DOWN,
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
    pass_ops,
)

OTHER, OUTSIDE = "other", "outside the layers"
# A kernel of a merged op may be measured alone (split-KV's combine after the fused kernel).
MERGED = {ROPE_ATTENTION: (ROPE, ATTENTION)}

PRODUCT, BEFORE, AFTER = "product", "before a product", "after a product"
NORM, ADD_NORMS = "norm", "add + norms"
# Lower-case kernel-name substrings, first match first, and the part each kernel plays. A
# layer's n-th product is its n-th projection; a per-token fp8 quantize belongs to the
# product after it, the SiLU-mul and cuBLAS's split-K reduction to the product before.
KERNEL_KINDS: tuple[tuple[str, str], ...] = (
    ("_rope_attend_kernel", ROPE_ATTENTION),
    ("_rope_write", ROPE),  # per row and head, or per row
    ("_paged_attention_kernel", ATTENTION),
    ("_combine_splits_kernel", ATTENTION),
    ("paged_decode_d", ATTENTION),  # kernels/csrc/paged_attention.cu
    ("_add_rms_norm2_kernel", ADD_NORMS),
    ("_rms_norm_kernel", NORM),
    ("_quantize_rows_kernel", BEFORE),
    ("_silu_mul_kernel", AFTER),
    ("splitkreduce", AFTER),
    ("_skinny_linear_kernel", PRODUCT),
    ("_strip_gemv_kernel", PRODUCT),
    ("_w8a8_kernel", PRODUCT),
    ("w8a16_n", PRODUCT),  # kernels/csrc/few_row_gemm.cu
    ("w16a16_n", PRODUCT),
    ("gemm", PRODUCT),  # cuBLAS, cuBLASLt and CUTLASS kernels
    ("gemv", PRODUCT),
    ("nvjet", PRODUCT),
    ("xmma", PRODUCT),
    ("cutlass", PRODUCT),
)
PROJECTIONS = (QKV, O_PROJ, GATE_UP, DOWN)
NORMS = (ATTENTION_NORMS, MLP_NORMS)


def kernel_kind(name: str) -> str:
    """The part a kernel of this name plays (KERNEL_KINDS), OTHER where none matches."""
    lower = name.lower()
    return next((kind for part, kind in KERNEL_KINDS if part in lower), OTHER)


def marginal_us(kernels: list[tuple[str, float, float]]) -> list[tuple[str, float]]:
    """(name, start, end) of a stream's kernels as (name, time each adds to the stream's busy
    time), in launch order: under programmatic dependent launch a kernel starts while its
    predecessor runs, and only its time past the predecessor's end is its own."""
    busy_until = float("-inf")
    added = []
    for name, start, end in sorted(kernels, key=lambda kernel: kernel[1]):
        added.append((name, max(0.0, end - max(start, busy_until))))
        busy_until = max(busy_until, end)
    return added


@dataclass(frozen=True)
class Attribution:
    """Microseconds a layer (averaged over `layers` layers) and a pass (over `passes`
    passes) spent per op; `irregular` layers did not run exactly one product per
    projection, so their products' names may be wrong."""

    layer: dict[str, float]
    per_pass: dict[str, float]
    layers: int
    passes: int
    irregular: int


def attribute(kernels: list[tuple[str, float]], layers_per_pass: int) -> Attribution:
    """Split whole decode passes' kernels, in launch order, into their layers' ops: a
    pass's layers open with its input norm and each closes with its second add + norms."""
    layer_us: dict[str, float] = {}
    pass_us = {INPUT_NORM: 0.0, OUTSIDE: 0.0}
    layers = passes = irregular = products = norms = 0
    inside, pending, last = False, 0.0, OTHER

    def add(op: str, us: float) -> None:
        layer_us[op] = layer_us.get(op, 0.0) + us

    for name, us in kernels:
        kind = kernel_kind(name)
        if not inside:
            inside = kind == NORM
            passes += inside
            pass_us[INPUT_NORM if inside else OUTSIDE] += us
        elif kind == BEFORE:
            pending += us
        elif kind == PRODUCT:
            last = PROJECTIONS[products] if products < len(PROJECTIONS) else OTHER
            products += 1
            add(last, us + pending)
            pending = 0.0
        elif kind == AFTER:
            add(last, us)
        elif kind == ADD_NORMS:
            add(NORMS[norms], us)
            norms += 1
            if norms == len(NORMS):
                irregular += products != len(PROJECTIONS)
                layers += 1
                if pending:
                    add(OTHER, pending)
                products = norms = 0
                inside, pending, last = layers % layers_per_pass != 0, 0.0, OTHER
        else:
            add(kind if kind in (ROPE, ATTENTION, ROPE_ATTENTION) else OTHER, us)
    return Attribution(
        {op: us / layers for op, us in layer_us.items()} if layers else {},
        {op: us / passes for op, us in pass_us.items()} if passes else {},
        layers,
        passes,
        irregular,
    )


def fold(measured: dict[str, float], names: list[str]) -> dict[str, float]:
    """Measured times under the bound's op names: a part of a merged op goes to it, a name
    the bounds lack to OTHER."""
    out: dict[str, float] = {}
    for op, us in measured.items():
        merged = (m for m in names if op in MERGED.get(m, ()))
        target = op if op in names else next(merged, OTHER)
        out[target] = out.get(target, 0.0) + us
    return out


# Cells of the budget table: (heading, width); the last two only where measured.
BUDGET_COLUMNS = (
    ("op", 28),
    ("MB", 9),
    ("GFLOP", 9),
    ("bytes us", 10),
    ("FLOPs us", 10),
    ("limit", 7),
    ("bound us", 10),
    ("measured us", 13),
    ("x bound", 9),
)


def _budget_line(cells: list[str]) -> str:
    """Cells under BUDGET_COLUMNS' headings: the op's to the left, the others to the right."""
    widths = [width for _, width in BUDGET_COLUMNS][: len(cells)]
    pairs = zip(cells[1:], widths[1:], strict=True)
    return cells[0].ljust(widths[0]) + "".join(cell.rjust(width) for cell, width in pairs)


@dataclass(frozen=True)
class Measured:
    """Decode passes of some rows on a GPU: the positions a row attends (the mean), a pass's
    host (launch) and device ms, and what its kernels spent per op."""

    context: int
    host_ms: float
    device_ms: float
    kernels: Attribution


def budget_record(
    name: str,
    shape: LayerShape,
    rows: int,
    weights: str,
    kv_dtype: str,
    context: int,
    device: Device,
    measured: Measured | None = None,
) -> dict:
    """One layer's budget at `rows` rows (context: the measured one where given), each op's
    bytes, FLOPs, bounds and measured time, and a pass's bound and time; times in us."""
    context = measured.context if measured else context
    ops = layer_ops(shape, rows, weights, 2 if kv_dtype == "auto" else 1, context)
    spent = fold(measured.kernels.layer, [op.name for op in ops]) if measured else {}
    record = {"budget": name, "rows": rows, "weights": weights, "kv_cache_dtype": kv_dtype}
    record.update(context=context, bandwidth=device.bandwidth, bf16_flops=device.bf16_flops)
    record.update(fp8_flops=device.fp8_flops, layers=shape.layers, ops=[])
    for op in ops:
        entry = {"op": op.name, "bytes": op.bytes, "flops": op.flops, "fp8_rate": op.fp8}
        entry.update(bytes_us=round(op.bytes_us(device), 3), flops_us=round(op.flops_us(device), 3))
        entry.update(limit=op.limit(device), bound_us=round(op.bound_us(device), 3))
        if measured:
            entry["measured_us"] = round(spent.get(op.name, 0.0), 3)
        record["ops"].append(entry)
    record["layer_bound_us"] = round(layer_bound_us(ops, device), 3)
    extra = pass_ops(shape, rows)
    record["pass_ops_bound_us"] = {op.name: round(op.bound_us(device), 3) for op in extra}
    pass_bound = shape.layers * layer_bound_us(ops, device) + layer_bound_us(extra, device)
    record["pass_bound_us"] = round(pass_bound, 1)
    if measured:
        kernels = measured.kernels
        record["other_us"] = round(spent.get(OTHER, 0.0), 3)
        record["layer_measured_us"] = round(sum(spent.values()), 3)
        record.update(pass_host_ms=round(measured.host_ms, 3))
        record.update(pass_device_ms=round(measured.device_ms, 3))
        record["pass_kernels_us"] = {op: round(us, 3) for op, us in kernels.per_pass.items()}
        record.update(layers_seen=kernels.layers, passes_seen=kernels.passes)
        record["irregular_layers"] = kernels.irregular
    return record


def print_budget(record: dict) -> None:
    """A budget_record as a table, then as a JSON line."""
    measured = "layer_measured_us" in record
    kv = "bf16" if record["kv_cache_dtype"] == "auto" else record["kv_cache_dtype"]
    rows = f"{record['rows']} row{'s' if record['rows'] > 1 else ''}"
    print(
        f"{record['budget']}, {rows}, {record['weights']} weights, {kv} K/V, "
        f"{record['context']} positions a row: a layer's bound {record['layer_bound_us']:.2f} us"
    )
    headings = [heading for heading, _ in BUDGET_COLUMNS]
    print(_budget_line(headings if measured else headings[:-2]))
    ops = record["ops"]
    for op in ops:
        cells = [op["op"], f"{op['bytes'] / 1e6:.2f}", f"{op['flops'] / 1e9:.3f}"]
        cells += [f"{op['bytes_us']:.2f}", f"{op['flops_us']:.2f}", op["limit"]]
        cells.append(f"{op['bound_us']:.2f}")
        if measured:
            cells += [f"{op['measured_us']:.2f}", f"{op['measured_us'] / op['bound_us']:.2f}"]
        print(_budget_line(cells))
    if measured:
        print(_budget_line([OTHER] + [""] * 6 + [f"{record['other_us']:.2f}", ""]))
    cells = ["layer", f"{sum(op['bytes'] for op in ops) / 1e6:.2f}"]
    cells.append(f"{sum(op['flops'] for op in ops) / 1e9:.3f}")
    cells += [f"{sum(op[key] for op in ops):.2f}" for key in ("bytes_us", "flops_us")]
    cells += ["", f"{record['layer_bound_us']:.2f}"]
    if measured:
        total = record["layer_measured_us"]
        cells += [f"{total:.2f}", f"{total / record['layer_bound_us']:.2f}"]
    print(_budget_line(cells))
    parts = " + ".join(f"{op} {us:.2f}" for op, us in record["pass_ops_bound_us"].items())
    print(
        f"a pass's bound: {record['layers']} layers x {record['layer_bound_us']:.2f} us + "
        f"{parts} = {record['pass_bound_us']:.1f} us"
    )
    if measured:
        per_pass = record["pass_kernels_us"]
        print(
            f"measured a pass: {record['pass_device_ms'] * 1e3:.1f} us on the device "
            f"({record['pass_host_ms'] * 1e3:.1f} us to launch); its kernels: "
            f"{record['layers']} layers x {total:.2f} us, {INPUT_NORM} "
            f"{per_pass.get(INPUT_NORM, 0.0):.2f} us, {OUTSIDE} {per_pass.get(OUTSIDE, 0.0):.2f} us"
        )
        expected = record["layers"] * record["passes_seen"]
        if record["irregular_layers"] or record["layers_seen"] != expected or not expected:
            print(
                f"warning: {record['layers_seen']} layers in {record['passes_seen']} passes, "
                f"{record['irregular_layers']} of them without four products: the split by op "
                "is unreliable"
            )
    print(json.dumps(record))
