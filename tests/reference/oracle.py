"""Serial Ouro oracle: one request, one token, one loop at a time (docs/design.md §3, §6).

Written from docs/design.md §3 and the published Ouro model definition (Hugging Face
`modeling_ouro.py`) only, never from the engine code, so that the engine can be checked
against it. The KV rules of docs/design.md §3.3 are applied as written. Everything runs in
float32 on the CPU; clarity beats speed.
"""

from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

import torch

LAYOUTS = ("last_exited", "shared", "shared_decode")
EXIT_MODES = ("ouro", "ouro_delayed", "trace")


@dataclass
class ReferenceResult:
    """What one request produced: tokens, exit depths, and the logits behind each."""

    # generated tokens
    token_ids: list[int]
    # one per generated token; the first is T (prefill)
    exit_depths: list[int]
    # float32 [vocab] logits that produced each generated token
    logits: list[torch.Tensor]


class _Ouro:
    """Ouro maths as in the HF `modeling_ouro.py`, over rows of one sequence; no KV caching."""

    def __init__(self, config: dict, weights: dict[str, torch.Tensor]) -> None:
        self.num_layers: int = config["num_hidden_layers"]
        self.num_loops: int = config["total_ut_steps"]
        self.num_heads: int = config["num_attention_heads"]
        self.num_kv_heads: int = config["num_key_value_heads"]
        hidden = config["hidden_size"]
        self.head_dim: int = config.get("head_dim") or hidden // self.num_heads
        self.eps: float = config["rms_norm_eps"]
        self.rope_theta: float = config["rope_theta"]
        self.w = {name: t.to(torch.float32) for name, t in weights.items()}

    def _layer_weight(self, layer: int, name: str) -> torch.Tensor:
        return self.w[f"model.layers.{layer}.{name}.weight"]

    def rms_norm(self, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return g * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE over the full head dim; x: [n, heads, d], positions: [n]."""
        d = self.head_dim
        exponents = torch.arange(0, d, 2, dtype=torch.float32) / d
        inv_freq = 1.0 / (self.rope_theta**exponents)  # [d/2]
        angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [n, d/2]
        emb = torch.cat([angles, angles], dim=-1)[:, None, :]  # [n, 1, d]
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return x * emb.cos() + torch.cat([-x2, x1], dim=-1) * emb.sin()

    def embed(self, token_ids: list[int]) -> torch.Tensor:
        # [n, hidden]
        return self.w["model.embed_tokens.weight"][torch.tensor(token_ids)]

    def qkv(
        self, layer: int, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Post-RoPE q [n, heads, d] and k, v [n, kv_heads, d] of rows x [n, hidden]."""
        a = self.rms_norm(x, self._layer_weight(layer, "input_layernorm"))
        q = a @ self._layer_weight(layer, "self_attn.q_proj").T
        k = a @ self._layer_weight(layer, "self_attn.k_proj").T
        v = a @ self._layer_weight(layer, "self_attn.v_proj").T
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        return self.rope(q, positions), self.rope(k, positions), v

    def finish_layer(
        self,
        layer: int,
        x: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Attention of q [n, heads, d] over k/v [m, kv_heads, d], then the rest of the
        sandwich-norm block on rows x [n, hidden]; mask: [n, m], True = visible.
        """
        # kv head h // group serves query head h
        group = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(group, dim=1)  # [m, heads, d]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,mhd->hnm", q, k) / (self.head_dim**0.5)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        attn = torch.einsum("hnm,mhd->nhd", scores.softmax(dim=-1), v)
        attn = attn.reshape(x.shape[0], -1)  # [n, heads * d]
        o = attn @ self._layer_weight(layer, "self_attn.o_proj").T
        x = x + self.rms_norm(o, self._layer_weight(layer, "input_layernorm_2"))
        b = self.rms_norm(x, self._layer_weight(layer, "post_attention_layernorm"))
        gate = b @ self._layer_weight(layer, "mlp.gate_proj").T
        up = b @ self._layer_weight(layer, "mlp.up_proj").T
        down = self._layer_weight(layer, "mlp.down_proj")
        mlp = (torch.nn.functional.silu(gate) * up) @ down.T
        g_mlp = self._layer_weight(layer, "post_attention_layernorm_2")
        return x + self.rms_norm(mlp, g_mlp)

    def end_loop(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm closes every loop; it feeds the next loop, gate and head."""
        return self.rms_norm(x, self.w["model.norm.weight"])

    def hazard(self, h: torch.Tensor) -> torch.Tensor:
        """Exit hazard sigmoid(gate(h)) of one row h [1, hidden], as a 0-d tensor."""
        w_gate = self.w["model.early_exit_gate.weight"]  # [1, hidden]
        z = h @ w_gate.T + self.w["model.early_exit_gate.bias"]
        return torch.sigmoid(z).reshape(())

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.w["lm_head.weight"].T  # [n, vocab]


class _KVStore:
    """Every K/V ever computed: per layer, [loop, position, kv_head, head_dim].

    Loops are 0-based here. Entries are written once, when computed, and never copied or
    overwritten; entries never computed stay NaN, so a read breaking the rules poisons
    the output.
    """

    def __init__(self, model: _Ouro, capacity: int, prompt_len: int) -> None:
        self.prompt_len = prompt_len
        shape = (model.num_loops, capacity, model.num_kv_heads, model.head_dim)
        self.k = [torch.full(shape, float("nan")) for _ in range(model.num_layers)]
        self.v = [torch.full(shape, float("nan")) for _ in range(model.num_layers)]
        # 1-based exit depth e_j of every finished token
        self.exit_depth = torch.zeros(capacity, dtype=torch.long)

    def source_loops(self, layout: str, position: int, loop: int) -> torch.Tensor:
        """For the query at `position` in its 1-based loop `loop`: the 0-based loop at
        which each of positions 0..position is read (docs/design.md §3.3).
        """
        earlier = self.exit_depth[:position]  # e_j, j < position
        # SHARED_DECODE reads like LAST_EXITED while the prompt prefills (every e_j is T
        # there, so min(t, e_j) = t), and like SHARED once decoding: final K/V (loop e_j).
        prefilling = layout == "shared_decode" and position < self.prompt_len
        if layout == "last_exited" or prefilling:
            earlier = torch.clamp(earlier, max=loop)  # min(t, e_j)
        own = torch.tensor([loop])  # the query's own position: its current loop
        return torch.cat([earlier, own]) - 1

    def write(self, layer: int, loop: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer][loop - 1, pos] = k
        self.v[layer][loop - 1, pos] = v

    def read(self, layer: int, source_loops: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V [positions, kv_heads, d], position j taken at loop source_loops[j]."""
        positions = torch.arange(source_loops.shape[0])
        k = self.k[layer][source_loops, positions]
        v = self.v[layer][source_loops, positions]
        return k, v


def _run_token(
    model: _Ouro,
    store: _KVStore,
    layout: str,
    position: int,
    token_id: int,
    exits_after: Callable[[int, torch.Tensor], bool],
) -> tuple[torch.Tensor, int]:
    """Run one token loop by loop until exits_after(loop, h) is true.

    Returns the exit loop's normalised state h [1, hidden] and the exit depth.
    """
    positions = torch.tensor([position])
    x = model.embed([token_id])  # [1, hidden]
    for loop in range(1, model.num_loops + 1):
        source_loops = store.source_loops(layout, position, loop)
        for layer in range(model.num_layers):
            q, k, v = model.qkv(layer, x, positions)
            store.write(layer, loop, position, k[0], v[0])
            k_all, v_all = store.read(layer, source_loops)
            x = model.finish_layer(layer, x, q, k_all, v_all, mask=None)
        x = model.end_loop(x)
        if exits_after(loop, x):
            store.exit_depth[position] = loop
            return x, loop
    raise AssertionError(f"token at position {position} never exited")


def _exit_at(depth: int) -> Callable[[int, torch.Tensor], bool]:
    """Exit test of a token whose depth is fixed in advance (prefill: T; trace mode)."""
    return lambda loop, h: loop == depth


class _OuroExit:
    """Exit test for `ouro` / `ouro_delayed` (docs/design.md §3.4).

    A fresh instance serves each decode token, since the CDF resets for every token.
    """

    def __init__(
        self, model: _Ouro, mode: str, threshold: float, min_loops: int, max_loops: int
    ) -> None:
        self.model = model
        self.mode = mode
        # F is compared with q in float32
        self.threshold = torch.tensor(threshold, dtype=torch.float32)
        self.min_loops = min_loops
        self.max_loops = max_loops
        # prod over loops s <= r of (1 - lambda_s)
        self.survival = torch.ones((), dtype=torch.float32)
        self.trigger: int | None = None

    def __call__(self, loop: int, h: torch.Tensor) -> bool:
        self.survival = self.survival * (1 - self.model.hazard(h))
        cdf = 1 - self.survival
        may_exit = self.threshold < 1 and loop >= self.min_loops
        if self.trigger is None and may_exit and cdf >= self.threshold:
            self.trigger = loop
        if loop == self.max_loops:
            return True
        if self.trigger is None:
            return False
        return loop == (self.trigger if self.mode == "ouro" else self.trigger + 1)


def _check_args(
    num_loops: int,
    prompt_ids: list[int],
    max_tokens: int,
    layout: str,
    exit_mode: str,
    min_loops: int,
    max_loops: int,
    trace: list[int] | None,
) -> None:
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if exit_mode not in EXIT_MODES:
        raise ValueError(f"exit_mode must be one of {EXIT_MODES}, got {exit_mode!r}")
    if not 1 <= min_loops <= max_loops <= num_loops:
        raise ValueError(
            f"need 1 <= min_loops ({min_loops}) <= max_loops ({max_loops}) <= T ({num_loops})"
        )
    if exit_mode == "trace":
        if not trace or trace[0] != num_loops:
            raise ValueError(f"trace must start with T={num_loops}, got {trace}")
        if any(not 1 <= d <= num_loops for d in trace):
            raise ValueError(f"trace depths must lie in [1, {num_loops}]: {trace}")


@torch.no_grad()
def reference_generate(
    config: dict,
    weights: dict[str, torch.Tensor],
    prompt_ids: list[int],
    *,
    max_tokens: int,
    layout: str = "last_exited",
    exit_mode: str = "ouro",
    exit_threshold: float = 1.0,
    min_loops: int = 1,
    max_loops: int | None = None,
    trace: list[int] | None = None,
    eos_token_ids: AbstractSet[int] = frozenset(),
    ignore_eos: bool = False,
    min_tokens: int = 0,
) -> ReferenceResult:
    """Greedy generation for one request, exactly as docs/design.md §3 defines it.

    `trace` (exit_mode="trace") holds T first, then each decode input's depth in order.
    """
    model = _Ouro(config, weights)
    num_loops = model.num_loops
    max_loops = num_loops if max_loops is None else max_loops
    _check_args(
        num_loops,
        prompt_ids,
        max_tokens,
        layout,
        exit_mode,
        min_loops,
        max_loops,
        trace,
    )
    # The last sampled token is never forwarded (docs/design.md §3.6).
    store = _KVStore(model, capacity=len(prompt_ids) + max_tokens - 1, prompt_len=len(prompt_ids))

    full_depth = _exit_at(num_loops)
    for position, token_id in enumerate(prompt_ids):
        h, depth = _run_token(model, store, layout, position, token_id, full_depth)

    result = ReferenceResult(token_ids=[], exit_depths=[], logits=[])
    while True:
        logits = model.logits(h)[0]
        token_id = int(torch.argmax(logits))
        result.token_ids.append(token_id)
        result.exit_depths.append(depth)
        result.logits.append(logits)
        num_generated = len(result.token_ids)
        if num_generated == max_tokens:
            break
        is_eos = token_id in eos_token_ids and not ignore_eos
        if is_eos and num_generated >= min_tokens:
            break
        decode_index = num_generated - 1  # index of this token among decode inputs
        if exit_mode == "trace":
            if decode_index + 1 >= len(trace):
                raise ValueError(f"trace has no depth for decode input {decode_index}")
            exits_after = _exit_at(trace[decode_index + 1])
        else:
            exits_after = _OuroExit(model, exit_mode, exit_threshold, min_loops, max_loops)
        position = len(prompt_ids) + decode_index
        h, depth = _run_token(model, store, layout, position, token_id, exits_after)
    return result


@torch.no_grad()
def reference_dense_logits(
    config: dict, weights: dict[str, torch.Tensor], token_ids: list[int]
) -> torch.Tensor:
    """Cache-free forward of the whole sequence at fixed depth T with causal attention.

    Returns float32 logits [len(token_ids), vocab] of the last loop. With fixed depth,
    LAST_EXITED must reproduce them (docs/design.md §3.3, §6).
    """
    model = _Ouro(config, weights)
    n = len(token_ids)
    positions = torch.arange(n)
    causal = torch.ones(n, n, dtype=torch.bool).tril()  # [query, key]
    x = model.embed(token_ids)  # [n, hidden]
    for _ in range(model.num_loops):
        for layer in range(model.num_layers):
            q, k, v = model.qkv(layer, x, positions)
            x = model.finish_layer(layer, x, q, k, v, mask=causal)
        x = model.end_loop(x)
    return model.logits(x)
