"""The naive baseline: dense eager PyTorch in the style of the Hugging Face modeling code.

A static batch, one contiguous K/V cache per (loop, layer), every loop for every token, one
kernel launch per operation from Python. It shares the model's weights, so the only
difference with the engine is how the work is executed. `naive_baseline` picks the
family's: Ouro's whole stack loops; Huginn's prelude and coda run once per token around a
looped block, with one K/V cache per (step, block layer) as its own cache keeps them.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from vllm_rlt.layers.norm import rms_norm
from vllm_rlt.models.huginn import HuginnModel
from vllm_rlt.models.ouro import OuroModel


def _branch(output: torch.Tensor, weight: torch.Tensor | None, cfg) -> torch.Tensor:
    """Ouro's sandwich norm on a branch output; families without one add it as is."""
    return output if weight is None else rms_norm(output, weight, cfg.rms_norm_eps)


class _StaticBatch:
    """Greedy generation of a static batch, prompt then one token at a time, timed; the
    family says what `_logits` runs."""

    length: int  # positions already in the caches

    def _logits(self, tokens: torch.Tensor, loops: int) -> torch.Tensor:
        """tokens [batch, new] at positions length.. -> last position's logits [batch, vocab]."""
        raise NotImplementedError

    @torch.inference_mode()
    def generate(self, prompts: torch.Tensor, output_len: int, loops: int) -> dict[str, float]:
        """Greedy generation for a [batch, prompt_len] batch (the prompt at full depth);
        returns timing figures and keeps the tokens in `generated` [batch, output_len]."""
        sync = torch.cuda.synchronize if prompts.is_cuda else (lambda: None)
        sync()
        start = time.perf_counter()
        tokens = self._logits(prompts, self.model.config.num_loops).argmax(-1)
        generated = [tokens]
        sync()
        first = time.perf_counter()
        for _ in range(output_len - 1):
            tokens = self._logits(tokens.unsqueeze(1), loops).argmax(-1)
            generated.append(tokens)
        sync()
        end = time.perf_counter()
        self.generated = torch.stack(generated, dim=1)
        batch = prompts.shape[0]
        return {
            "ttft_s": first - start,
            "decode_tokens_per_s": batch * (output_len - 1) / max(end - first, 1e-9),
            "end_to_end_tokens_per_s": batch * output_len / (end - start),
        }


def _attend(q, k, v, k_cache, v_cache, start: int) -> torch.Tensor:
    """Dense causal attention of q [batch, heads, new, dim] over the cache after writing
    k, v ([batch, kv heads, new, dim]) at positions start..; [batch, new, heads * dim]."""
    b, heads, n, d = q.shape
    end = start + n
    k_cache[:, :, start:end] = k
    v_cache[:, :, start:end] = v
    keys, values = k_cache[:, :, :end], v_cache[:, :, :end]
    if keys.shape[1] != heads:
        keys = keys.repeat_interleave(heads // keys.shape[1], 1)
        values = values.repeat_interleave(heads // values.shape[1], 1)
    mask = None
    if n > 1:
        mask = torch.ones(n, end, dtype=torch.bool, device=q.device).tril(start)
    attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
    return attn.transpose(1, 2).reshape(b, n, heads * d)


class NaiveOuro(_StaticBatch):
    def __init__(self, model: OuroModel, batch: int, max_len: int) -> None:  # any loop family
        cfg = model.config
        self.model = model
        shape = (batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        slots = cfg.num_loops * cfg.num_hidden_layers
        self.k = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(slots)]
        self.v = [torch.zeros_like(t) for t in self.k]
        self.length = 0

    def _forward(self, hidden: torch.Tensor, loops: int) -> torch.Tensor:
        """hidden [batch, new, hidden] at positions length.. -> final-loop state."""
        model, cfg = self.model, self.model.config
        b, n, _ = hidden.shape
        d, heads, kv_heads = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        start, end = self.length, self.length + n
        positions = torch.arange(start, end, device=hidden.device)
        for loop in range(loops):
            for index, layer in enumerate(model.layers):
                slot = loop * cfg.num_hidden_layers + index
                a = rms_norm(hidden, layer.attn_norm, cfg.rms_norm_eps)
                q, k, v = F.linear(a, layer.qkv).split([heads * d, kv_heads * d, kv_heads * d], -1)
                q = model.rotary.apply(q.reshape(b * n, heads, d), positions.repeat(b))
                k = model.rotary.apply(k.reshape(b * n, kv_heads, d), positions.repeat(b))
                q = q.view(b, n, heads, d).transpose(1, 2)
                k, v = (t.view(b, n, kv_heads, d).transpose(1, 2) for t in (k, v))
                attn = _attend(q, k, v, self.k[slot], self.v[slot], start)
                hidden = hidden + _branch(F.linear(attn, layer.o), layer.attn_out_norm, cfg)
                gate, up = (
                    F.linear(rms_norm(hidden, layer.mlp_norm, cfg.rms_norm_eps), layer.gate_up)
                    .unflatten(-1, (-1, 2))
                    .unbind(-1)
                )  # interleaved gate/up columns
                mlp = F.linear(F.silu(gate) * up, layer.down)
                hidden = hidden + _branch(mlp, layer.mlp_out_norm, cfg)
            hidden = rms_norm(hidden, model.final_norm, cfg.rms_norm_eps)
        self.length = end
        return hidden

    def _logits(self, tokens: torch.Tensor, loops: int) -> torch.Tensor:
        hidden = self._forward(self.model.prelude(tokens), loops)
        return self.model.coda(hidden[:, -1])


class NaiveHuginn(_StaticBatch):
    """Huginn's recurrence as its modeling code runs it: the prelude once, `loops` steps of
    the block from the drawn initial state (per request seed and position, as the engine
    draws it) with the adapter over (state, prelude output), then the coda and the head."""

    def __init__(
        self, model: HuginnModel, batch: int, max_len: int, seeds: torch.Tensor | None = None
    ) -> None:
        cfg = model.config
        self.model = model
        self.seeds = seeds if seeds is not None else torch.zeros(batch, dtype=torch.int64)
        shape = (batch, cfg.num_attention_heads, max_len, cfg.head_dim)
        once = cfg.num_prelude_layers + cfg.num_coda_layers
        slots = once + cfg.num_loops * cfg.num_core_layers
        self.k = [torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in range(slots)]
        self.v = [torch.zeros_like(t) for t in self.k]
        self.length = 0

    def _layer(self, index: int, cache: int, x: torch.Tensor, positions: torch.Tensor):
        """SandwichBlock `index` on x [batch, new, hidden] with K/V cache `cache`."""
        model, cfg = self.model, self.model.config
        layer, eps = model.layers[index], cfg.rms_norm_eps
        b, n, width = x.shape
        heads, d = cfg.num_attention_heads, cfg.head_dim
        norm_1, norm_2, norm_3, norm_4 = layer.norms
        qkv = F.linear(rms_norm(x, norm_1, eps), layer.qkv)
        if layer.qk_bias is not None:
            qkv[..., : 2 * width] += layer.qk_bias.view(-1)
        q, k, v = qkv[..., model.columns].split(width, dim=-1)  # RoPE halves, as the engine's
        q, k = (model.rotary.apply(t.reshape(b * n, heads, d), positions) for t in (q, k))
        q, k, v = (t.reshape(b, n, heads, d).transpose(1, 2) for t in (q, k, v))
        attn = _attend(q, k, v, self.k[cache], self.v[cache], self.length)
        x = rms_norm(x + F.linear(attn, layer.proj), norm_2, eps)
        gate, up = F.linear(rms_norm(x, norm_3, eps), layer.fc).chunk(2, dim=-1)
        return rms_norm(x + F.linear(F.silu(gate) * up, layer.down), norm_4, eps)

    def _logits(self, tokens: torch.Tensor, loops: int) -> torch.Tensor:
        model, cfg = self.model, self.model.config
        b, n = tokens.shape
        steps = range(cfg.num_prelude_layers, cfg.num_prelude_layers + cfg.num_core_layers)
        coda = range(steps.stop, steps.stop + cfg.num_coda_layers)
        positions = torch.arange(self.length, self.length + n, device=tokens.device)
        flat = positions.repeat(b)  # [batch * new]
        injected = model.embed[tokens] * cfg.embed_scale
        for index in range(cfg.num_prelude_layers):
            injected = self._layer(index, index, injected, flat)
        seeds = self.seeds.to(tokens.device).repeat_interleave(n)
        state = model.initial_state(seeds, flat).view(b, n, -1)
        for step in range(loops):
            x = F.linear(torch.cat([state, injected], dim=-1), model.adapter, model.adapter_bias)
            for offset, index in enumerate(steps):
                cache = len(coda) + cfg.num_prelude_layers + step * len(steps) + offset
                x = self._layer(index, cache, x, flat)
            state = x
        out = rms_norm(state, model.ln_f, cfg.rms_norm_eps)
        for offset, index in enumerate(coda):
            out = self._layer(index, cfg.num_prelude_layers + offset, out, flat)
        self.length += n
        return model.coda(out[:, -1])


def naive_baseline(model, batch: int, max_len: int) -> _StaticBatch:
    """The family's naive baseline for a batch of `batch` rows of at most max_len positions."""
    if isinstance(model, HuginnModel):
        return NaiveHuginn(model, batch, max_len)
    return NaiveOuro(model, batch, max_len)
