"""The naive baseline: dense eager PyTorch in the style of the Hugging Face modeling code.

A static batch, one contiguous K/V cache per (loop, layer), every loop for every token, one
kernel launch per operation from Python. It shares the model's weights, so the only
difference with the engine is how the work is executed.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from vllm_rlt.layers.norm import rms_norm
from vllm_rlt.models.ouro import OuroModel


def _branch(output: torch.Tensor, weight: torch.Tensor | None, cfg) -> torch.Tensor:
    """Ouro's sandwich norm on a branch output; families without one add it as is."""
    return output if weight is None else rms_norm(output, weight, cfg.rms_norm_eps)


class NaiveOuro:
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
                self.k[slot][:, :, start:end] = k.view(b, n, kv_heads, d).transpose(1, 2)
                self.v[slot][:, :, start:end] = v.view(b, n, kv_heads, d).transpose(1, 2)
                keys, values = self.k[slot][:, :, :end], self.v[slot][:, :, :end]
                if kv_heads != heads:
                    keys = keys.repeat_interleave(heads // kv_heads, 1)
                    values = values.repeat_interleave(heads // kv_heads, 1)
                mask = None
                if n > 1:
                    mask = torch.ones(n, end, dtype=torch.bool, device=hidden.device).tril(start)
                attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
                attn = attn.transpose(1, 2).reshape(b, n, heads * d)
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

    @torch.inference_mode()
    def generate(self, prompts: torch.Tensor, output_len: int, loops: int) -> dict[str, float]:
        """Greedy generation for a [batch, prompt_len] batch; returns timing figures."""
        sync = torch.cuda.synchronize if prompts.is_cuda else (lambda: None)
        sync()
        start = time.perf_counter()
        hidden = self._forward(self.model.prelude(prompts), self.model.config.num_loops)
        tokens = self.model.coda(hidden[:, -1]).argmax(-1)
        sync()
        first = time.perf_counter()
        for _ in range(output_len - 1):
            hidden = self._forward(self.model.prelude(tokens).unsqueeze(1), loops)
            tokens = self.model.coda(hidden[:, -1]).argmax(-1)
        sync()
        end = time.perf_counter()
        batch = prompts.shape[0]
        return {
            "ttft_s": first - start,
            "decode_tokens_per_s": batch * (output_len - 1) / max(end - first, 1e-9),
            "end_to_end_tokens_per_s": batch * output_len / (end - start),
        }
