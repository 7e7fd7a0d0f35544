"""FP8 weights (`quantization="fp8"`) and the element type of an FP8 KV cache.

FP8 weights: the projections of every layer are stored as float8
e4m3 with one float32 scale per output row, computed at load time from the row's largest
magnitude. Decode streams these weights once per loop, so half the bytes is nearly half the
time of a weight-bound pass. The embedding, the LM head, the exit gate and the norms stay
in the model's dtype: they are a small share of the bytes, and the head and the gate decide
tokens and exits directly.

A backend computes x @ W.T as (x @ data.T) * scale, with the scale applied to the float32
accumulator, so the product is the same whichever kernel runs it, up to summation order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


def _row_scales(weight: torch.Tensor) -> torch.Tensor:
    """One float32 scale per row, so that the row's largest magnitude maps to FP8_MAX (an
    all-zero row gets scale 1)."""
    amax = weight.abs().amax(dim=1).float()
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def _to_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (weight.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


@dataclass
class Fp8Weight:
    """A weight W [N, K] as data [N, K] in float8 e4m3 and scale [N] in float32, with
    W ~= data * scale[:, None]. Row indexing gives the matching rows of both (views), so a
    checkpoint tensor that is a row range of a fused weight stays addressable in place."""

    data: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Fp8Weight:
        if weight.dim() != 2:
            raise ValueError(f"fp8 quantization needs a 2-D weight, got {tuple(weight.shape)}")
        scale = _row_scales(weight)
        return cls(_to_fp8(weight, scale).contiguous(), scale.contiguous())

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def __getitem__(self, rows) -> Fp8Weight:
        return Fp8Weight(self.data[rows], self.scale[rows])

    def columns(self, start: int, end: int) -> Fp8Weight:
        """Input columns [start, end) as a weight of their own (a copy): the row scales
        stay, so the products of column ranges add up to the whole product."""
        return Fp8Weight(self.data[:, start:end].contiguous(), self.scale)

    @classmethod
    def cat_rows(cls, parts: list[Fp8Weight]) -> Fp8Weight:
        return cls(
            torch.cat([p.data for p in parts]).contiguous(),
            torch.cat([p.scale for p in parts]).contiguous(),
        )

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scale.numel() * 4

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data, self.scale

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.data.float() * self.scale[:, None]).to(dtype)

    def copy_(self, weight: torch.Tensor) -> Fp8Weight:
        """Quantize `weight` (the same shape, any float dtype) into this storage in place."""
        weight = weight.to(self.data.device)
        scale = _row_scales(weight)
        self.scale.copy_(scale)
        self.data.copy_(_to_fp8(weight, scale))
        return self


def weight_nbytes(weight: torch.Tensor | Fp8Weight) -> int:
    if isinstance(weight, Fp8Weight):
        return weight.nbytes()
    return weight.numel() * weight.element_size()


def cat_weight_rows(parts: list[torch.Tensor] | list[Fp8Weight]) -> torch.Tensor | Fp8Weight:
    """Row blocks of a weight (tensors or Fp8Weights) as one contiguous weight."""
    if isinstance(parts[0], Fp8Weight):
        return Fp8Weight.cat_rows(parts)
    return torch.cat(parts).contiguous()


def weight_columns(
    weight: torch.Tensor | Fp8Weight, start: int, end: int
) -> torch.Tensor | Fp8Weight:
    """Input columns [start, end) of a weight (a tensor or an Fp8Weight), contiguous."""
    if isinstance(weight, Fp8Weight):
        return weight.columns(start, end)
    return weight[:, start:end].contiguous()


def fp8_linear_reference(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """x @ W.T for an fp8 weight in plain torch, as the kernels compute it: the float8
    values (exact in float32) summed in float32 and scaled per output column there, then
    rounded once. In x's dtype, float16 would overflow before the scale (float8 reaches
    448) and bf16 would round the scale."""
    return (F.linear(x.float(), weight.data.float()) * weight.scale).to(x.dtype)


def is_float8(tensor: torch.Tensor) -> bool:
    return tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def applied_kv_scales(
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None, cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The (K, V) scales a layer's cache applies: a float8 cache's, none for a cache in the
    model's dtype (as vLLM, which ignores a checkpoint's scales there)."""
    return kv_scales if is_float8(cache) else None


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of the K/V pool for CacheConfig.kv_cache_dtype."""
    if kv_cache_dtype == "auto":
        return model_dtype
    return torch.float8_e5m2 if kv_cache_dtype == "fp8_e5m2" else FP8_DTYPE
