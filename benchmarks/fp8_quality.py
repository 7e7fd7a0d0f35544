"""What FP8 weights and an FP8 KV cache change in a model's outputs, against the unquantized
model: the mean KL divergence and the top-1 agreement of the next-token distribution at
full depth, and how many exit decisions of the `ouro` rule at threshold q change per 1,000
tokens. Random prompts run teacher-forced through a dense forward (every position at every
loop, as prompts run), with the projections through the engine's reference ops, so fp8
weights compute as the engine's kernels do for few rows (weight-only, scaled per output
channel). The "activations per token" variant also rounds each row of a projection's input
to float8 with its own scale, as the FP8 tensor cores of passes above one row do; on a GPU
the "engine kernels" variant runs those products through the Triton backend itself, in
chunks of --kernel-rows rows, so the W8A8 tile (or cuBLAS product) a pass of that many rows
takes, with its accumulation, is what is measured. fp8 K/V
are rounded to float8 where they are written, at scale 1 or divided by per-head scales
calibrated on other random prompts as vLLM's calculate_kv_scales sets them (amax / 200 for
K, amax / 100 for V). On a GPU the "decode kernel" variants attend every position as a decode
row of the engine's CUDA paged attention (kernels/paged_attention_cuda.py) over a float8
cache holding its sequence's K/V, so the kernel's own float8 reads are what is measured.

python -m benchmarks.fp8_quality --shape ouro-1.4b --dtype bfloat16 --prompts 4 --prompt-len 128
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
from tqdm import tqdm

from vllm_rlt.bench.shapes import SHAPES, random_model
from vllm_rlt.cli_parser import CLIParser
from vllm_rlt.layers.fp8 import FP8_DTYPE, Fp8Weight, fp8_linear_reference
from vllm_rlt.layers.norm import rms_norm
from vllm_rlt.ops.torch_ops import TorchOps

# name -> (quantization, fp8 K/V ("kernel": read by the CUDA decode kernel), per-head K/V
# scales, fp8 activations ("kernels": the engine's W8A8 products))
VARIANTS = {
    "fp8 weights": ("fp8", False, False, False),
    "fp8 weights, activations per token": ("fp8", False, False, True),
    "fp8 weights, engine kernels": ("fp8", False, False, "kernels"),  # a GPU, bf16 only
    "fp8 KV": (None, True, False, False),
    "fp8 KV, per-head scales": (None, True, True, False),
    "fp8 KV, decode kernel": (None, "kernel", False, False),  # a GPU, bf16 only
    "fp8 KV, per-head scales, decode kernel": (None, "kernel", True, False),  # a GPU, bf16 only
    "fp8 weights + fp8 KV": ("fp8", True, False, False),
}
# vLLM's calculate_kv_scales: the calibration's largest |K| maps to 200, |V| to 100, so
# that larger values met later still fit float8 e4m3's 448.
K_SCALE_RANGE, V_SCALE_RANGE = 200.0, 100.0


def _branch(output: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return output if weight is None else rms_norm(output, weight, eps)


def per_token_fp8_product(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """x @ W.T with each row of x first rounded to float8 at its own scale (the row's
    largest magnitude to float8's largest value, as weight rows are quantized), as the FP8
    tensor-core path computes."""
    return fp8_linear_reference(Fp8Weight.quantize(x).dequantize(x.dtype), weight)


class PerTokenFp8Ops(TorchOps):
    """The reference ops with fp8 weights' products as `per_token_fp8_product`."""

    def linear(self, x, weight, live=None):
        if isinstance(weight, Fp8Weight):
            return per_token_fp8_product(x, weight)
        return super().linear(x, weight, live)


class KernelFp8Ops(TorchOps):
    """The reference ops with fp8 weights' products on the Triton backend's kernels (bf16
    only, as the engine runs them), in chunks of `rows` rows (the last chunk may be
    smaller, and take its own tile) quantized per token as the norms hand them on. Every
    product may split K, as o and down do in the engine, whose norm kernel sums the float32
    slices (qkv's and gate/up's tiles take one slice)."""

    def __init__(self, rows: int) -> None:
        from vllm_rlt.ops.triton_ops import TritonOps  # needs Triton: a GPU run only

        self.rows, self.kernels = rows, TritonOps()

    def _chunks(self, x: torch.Tensor, product) -> torch.Tensor:
        from vllm_rlt.kernels.fp8_rows import quantize_rows

        return torch.cat([product(quantize_rows(c)).to(x.dtype) for c in x.split(self.rows)])

    def linear(self, x, weight, live=None):
        from vllm_rlt.ops.fp8_products import fp8_product

        if isinstance(weight, Fp8Weight):
            return self._chunks(x, lambda c: fp8_product(c, weight, split_ok=True).sum(0))
        return super().linear(x, weight, live)

    def linear_silu_mul(self, x, gate_up, next_weight=None):
        if isinstance(gate_up, Fp8Weight):
            return self._chunks(x, lambda c: self.kernels.linear_silu_mul(c, gate_up))
        return super().linear_silu_mul(x, gate_up, next_weight)


def _through_fp8(t: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """What attention reads back of `t` [rows, kv_heads, dim] from a float8 cache that holds
    t / scale (per head)."""
    if scale is None:
        return t.to(FP8_DTYPE).to(t.dtype)
    return ((t.float() / scale[:, None]).to(FP8_DTYPE).float() * scale[:, None]).to(t.dtype)


def _float8_cache(t: torch.Tensor, scale: torch.Tensor | None, batch: int, padded: int):
    """[batch * length, kv_heads, dim] as a float8 cache of `padded` slots a sequence,
    holding t / scale (per head) as the engine's cache write rounds it."""
    rows, kv_heads, dim = t.shape
    t = t.float() if scale is None else t.float() / scale[:, None]
    cache = t.new_zeros(batch, padded, kv_heads, dim)
    cache[:, : rows // batch] = t.view(batch, -1, kv_heads, dim)
    return cache.to(FP8_DTYPE).view(batch * padded, kv_heads, dim)


def kernel_attention(q, k, v, batch: int, kv_scales=None) -> torch.Tensor:
    """Causal attention of q [batch * length, heads, dim] (bf16) over its sequence's K/V,
    every position a decode row of the CUDA kernel over a float8 cache, split runs joined
    by the engine's combine kernel."""
    from types import SimpleNamespace

    from vllm_rlt.kernels import paged_attention_cuda as cuda
    from vllm_rlt.kernels.decode_attention import attention_shape
    from vllm_rlt.ops.triton_ops import TritonOps

    rows, heads, dim = q.shape
    kv_heads, length, block = k.shape[1], rows // batch, 16
    padded = -(-length // block) * block
    device = q.device
    k_scale, v_scale = kv_scales or (None, None)
    caches = (_float8_cache(k, k_scale, batch, padded), _float8_cache(v, v_scale, batch, padded))
    sequence = torch.arange(batch, device=device).repeat_interleave(length)
    meta = SimpleNamespace(
        positions=torch.arange(length, device=device).repeat(batch),
        row_tables=sequence,
        read_plane=torch.zeros_like(sequence),
        block_table=torch.arange(batch * padded // block, device=device).view(batch, -1),
        slots_per_plane=batch * padded,
        block_size=block,
    )
    scaled = kv_scales is not None
    scales = (k_scale, v_scale) if scaled else (meta.positions,) * 2  # not read unscaled
    ops, splits, out = TritonOps(), cuda.decode_splits(rows, kv_heads), torch.empty_like(q)
    parts = ops._split_parts(out, splits)
    args = (q.contiguous(), (*caches, *scales), scaled, out, parts, meta, rows, splits)
    cuda.paged_decode(*args, None, dim**-0.5, False)
    shape = attention_shape(heads, kv_heads, dim, scaled)
    ops._combine_splits(parts, scales[1], out, rows, shape, splits)
    return out


def kernel_fits(model, device: torch.device) -> bool:
    """Whether the CUDA decode kernel attends this model's bf16 heads over float8 caches."""
    from vllm_rlt.kernels import paged_attention_cuda as cuda

    if device.type != "cuda":
        return False
    cfg = model.config
    q = torch.empty(1, cfg.num_attention_heads, cfg.head_dim, dtype=torch.bfloat16, device=device)
    cache = torch.empty(1, cfg.num_key_value_heads, cfg.head_dim, device=device).to(FP8_DTYPE)
    return cuda.fits_cuda_decode(q, cache, cfg.num_key_value_heads)


def _dense_attention(q, k, v, batch: int, fp8_kv: bool, kv_scales=None) -> torch.Tensor:
    """Causal attention of q [batch * length, heads, dim] over K/V as they are or as a
    float8 cache reads them back; [batch * length, heads * dim]."""
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    if fp8_kv:  # what attention reads back from a float8 cache
        k_scale, v_scale = kv_scales or (None, None)
        k, v = _through_fp8(k, k_scale), _through_fp8(v, v_scale)
    q, k, v = (t.view(batch, -1, t.shape[1], dim).transpose(1, 2) for t in (q, k, v))
    if kv_heads != heads:
        k = k.repeat_interleave(heads // kv_heads, 1)
        v = v.repeat_interleave(heads // kv_heads, 1)
    attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return attn.transpose(1, 2).reshape(-1, heads * dim)


@torch.inference_mode()
def loop_states(
    model, tokens: torch.Tensor, fp8_kv: bool | str, kv_scales=None, amax=None, ops=None
) -> list[torch.Tensor]:
    """The end-of-loop (normalised) state of every position after each loop, [B * T, hidden].
    kv_scales: per layer (K, V) scales of the float8 cache; amax: a list that collects each
    layer's largest |K| and |V| per head over every loop; ops: the projections' ops
    (TorchOps by default)."""
    cfg, ops = model.config, ops or TorchOps()
    batch, length = tokens.shape
    heads, kv_heads, dim, eps = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.rms_norm_eps,
    )
    positions = torch.arange(length, device=tokens.device).repeat(batch)
    hidden = model.prelude(tokens.flatten())
    states = []
    for _ in range(cfg.num_loops):
        x = hidden
        for index, layer in enumerate(model.layers):
            qkv = ops.linear(rms_norm(x, layer.attn_norm, eps), layer.qkv)
            q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
            q = model.rotary.apply(q.reshape(-1, heads, dim), positions)
            k = model.rotary.apply(k.reshape(-1, kv_heads, dim), positions)
            v = v.reshape(-1, kv_heads, dim)
            if amax is not None:
                heads_max = [t.abs().amax(dim=(0, 2)).float() for t in (k, v)]
                if len(amax) <= index:
                    amax.append(heads_max)
                else:
                    amax[index] = [
                        torch.maximum(a, b) for a, b in zip(amax[index], heads_max, strict=True)
                    ]
            scales = kv_scales[index] if kv_scales else None
            if fp8_kv == "kernel":
                attn = kernel_attention(q, k, v, batch, scales).view(batch * length, -1)
            else:
                attn = _dense_attention(q, k, v, batch, fp8_kv, scales)
            x = x + _branch(ops.linear(attn, layer.o), layer.attn_out_norm, eps)
            mlp = ops.linear_silu_mul(rms_norm(x, layer.mlp_norm, eps), layer.gate_up)
            x = x + _branch(ops.linear(mlp, layer.down), layer.mlp_out_norm, eps)
        hidden = rms_norm(x, model.final_norm, eps)
        states.append(hidden)
    return states


def exit_depths(model, states: list[torch.Tensor], threshold: float) -> torch.Tensor:
    """The `ouro` rule's depth per position: the first loop whose exit CDF reaches q."""
    survival = torch.ones(states[0].shape[0])
    depth = torch.full((states[0].shape[0],), len(states), dtype=torch.int64)
    for loop, state in enumerate(states[:-1], start=1):
        survival = survival * (1.0 - torch.sigmoid(model.gate(state).float().cpu()))
        leave = (1.0 - survival >= threshold) & (depth == len(states))
        depth[leave] = loop
    return depth


def calibrated_scales(model, tokens: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer and KV head, vLLM's calculate_kv_scales from the unquantized model's K and
    V over `tokens`."""
    amax: list = []
    loop_states(model, tokens, False, amax=amax)
    return [(k / K_SCALE_RANGE, v / V_SCALE_RANGE) for k, v in amax]


def summary(model, tokens, fp8_kv: bool | str, threshold: float, kv_scales=None, ops=None):
    states = loop_states(model, tokens, fp8_kv, kv_scales, ops=ops)
    logprobs = F.log_softmax(model.coda(states[-1]).float(), dim=-1).cpu()
    return logprobs, exit_depths(model, states, threshold)


def _ops(per_token: bool | str, rows: int) -> TorchOps | None:
    if per_token == "kernels":
        return KernelFp8Ops(rows)
    return PerTokenFp8Ops() if per_token else None


def main(argv: list[str] | None = None) -> int:
    parser = CLIParser(prog="python -m benchmarks.fp8_quality", description=__doc__)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="ouro-1.4b")
    parser.add_argument("--dtype", default="bfloat16", help="the unquantized model's dtype")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--prompts", type=int, default=4, help="random prompts")
    parser.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt")
    parser.add_argument("--threshold", type=float, default=0.5, help="the ouro rule's q")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and prompts")
    parser.add_argument(
        "--kernel-rows",
        type=int,
        default=256,
        help="rows per product of the engine-kernels variant (a GPU run only)",
    )
    args = parser.parse_args(argv)
    for name in ("prompts", "prompt_len", "kernel_rows"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    device = parser.device(args.device)
    dtype = getattr(torch, args.dtype, None)
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        parser.error(f"--dtype must be float32, float16 or bfloat16, got {args.dtype!r}")
    model = random_model(args.shape, dtype, device, args.seed)
    gpu_bf16 = device.type == "cuda" and dtype == torch.bfloat16
    kernel_here = gpu_bf16 and kernel_fits(model, device)
    variants = {  # the engine-kernel variants where they run
        name: variant
        for name, variant in VARIANTS.items()
        if (variant[3] != "kernels" or gpu_bf16) and (variant[1] != "kernel" or kernel_here)
    }
    generator = torch.Generator().manual_seed(args.seed)
    vocab = model.config.vocab_size
    tokens = torch.randint(3, vocab, (args.prompts, args.prompt_len), generator=generator)
    tokens = tokens.to(device)
    calibration = torch.randint(3, vocab, (args.prompts, args.prompt_len), generator=generator)
    with tqdm(total=1 + len(variants), desc="fp8 quality", unit="model", file=sys.stderr) as bar:
        reference, reference_depths = summary(model, tokens, False, args.threshold)
        # how flat the distributions are: random weights give nearly uniform ones, whose
        # top-1 token is decided by small margins
        entropy = -(reference.exp() * reference).sum(-1).mean().item()
        bar.update(1)
        quantized = None
        scales = calibrated_scales(model, calibration.to(device))
        for name, (quantization, fp8_kv, scaled, per_token) in variants.items():
            if quantization is not None and quantized is None:
                quantized = random_model(args.shape, dtype, device, args.seed)
                quantized.quantize(quantization)
            logprobs, depths = summary(
                model if quantization is None else quantized,
                tokens,
                fp8_kv,
                args.threshold,
                scales if scaled else None,
                _ops(per_token, args.kernel_rows),
            )
            kl = (reference.exp() * (reference - logprobs)).sum(-1)
            same_top1 = reference.argmax(-1) == logprobs.argmax(-1)
            changed = (depths != reference_depths).float().mean().item()
            print(
                json.dumps(
                    {
                        "variant": name,
                        "shape": args.shape,
                        "dtype": args.dtype,
                        "tokens": int(tokens.numel()),
                        "reference_mean_entropy": entropy,
                        "mean_kl": kl.mean().item(),
                        "max_kl": kl.max().item(),
                        "top1_agreement": same_top1.float().mean().item(),
                        "threshold": args.threshold,
                        "exit_changes_per_1000": 1000 * changed,
                        "mean_depth": depths.float().mean().item(),
                        "reference_mean_depth": reference_depths.float().mean().item(),
                    }
                ),
                flush=True,
            )
            bar.update(1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
