"""Serial Huginn-0125 oracle: one request, one token, one recurrence at a time.

Where the maths comes from
--------------------------
The public modeling file of Huginn (architecture `RavenForCausalLM`, `model_type`
`huginn_raven`): repository `seal-rg/recurrent-pretraining`, path
`recpre/raven_modeling_minimal.py`, commit `59e0b69b2d96a59cbbe79c9d5034d89ecb5ab6f6`
(config field names from `recpre/raven_config_minimal.py` at the same commit). This file is
written from that maths, not copied: plain loops over positions, float32 on the CPU, one
query row at a time, clarity over speed. Nothing here reads the engine.

The computation of one token at position p (all vectors [n_embd]):

- prelude: e = wte[token] * sqrt(n_embd), then each prelude SandwichBlock once;
- state: s_0 drawn from a truncated normal (below); for step r = 1..num_steps:
  s_r = core_block(adapter(concat(s_{r-1}, e))) (input injection: a linear map of
  [2 n_embd] -> [n_embd] over the previous state and the prelude output);
- coda: h = ln_f(s_R), each coda SandwichBlock once, ln_f again (the same norm weight),
  logits = h @ lm_head^T (lm_head = wte when tie_embeddings).

SandwichBlock: x = norm_2(x + proj(attn(norm_1(x)))); x = norm_4(x + mlp(norm_3(x))), with
RMSNorm(x) = x * rsqrt(mean(x^2) + norm_eps) * weight; attention from one fused Wqkv
(q, k, v in that order), `qk_bias` [2, 1, heads, head_dim] added to q and k before RoPE,
RoPE on interleaved pairs (2i, 2i+1) of each head with frequency rope_base^(-2i/head_dim),
softmax scale 1/sqrt(head_dim); GatedMLP: fc gives [gate | up], silu(gate) * up, then proj.

The KV cache is kept as Huginn's own `HuginnDynamicCache` keeps it: one entry per
(cache index, position), the cache index being i for prelude layer i, P + r*R + l for
block layer l at 0-based recurrence r (P prelude layers, R block layers), and -(i + 1) for
coda layer i. Every position writes its own entries before its query reads.

Choices made here (every place where the public file leaves room)
-----------------------------------------------------------------
1. Initial state. The public `initialize_state` draws `randn_like` and then overwrites it
   with `trunc_normal_(std, a=-3 std, b=3 std)` from the global RNG, std =
   sqrt(2 / (5 n_embd)) * init_scale, then multiplies by sqrt(n_embd); init_scale = 0 gives
   exact zeros. Here the distribution is the same, but each position's draw is a function
   of (seed, position) alone, so it does not depend on how the prompt is chunked or
   batched, and an engine can compute it on any device: element j of position p is
   std * Phi^-1(Phi(-3) + u (1 - 2 Phi(-3))) with u a counter-based uniform:
     mix(x) = murmur3's 32-bit finaliser (x ^= x >> 16; x *= 0x85EBCA6B; x ^= x >> 13;
              x *= 0xC2B2AE35; x ^= x >> 16, all mod 2^32);
     s = seed XOR 0x5EED57A7E0000001 (64 bits), lo / hi its 32-bit halves;
     base = mix(mix(lo ^ mix((hi + 0x9E3779B9) mod 2^32)) ^ (p mod 2^32));
     u = (floor(mix(base ^ mix(j + 0x632BE5AB)) / 2^8) + 0.5) / 2^24.
   The public RNG stream is not reproduced; a caller can pass `initial_state` to inject
   states (the public `input_states`).
2. Reads at a cache index a position did not compute (it ran fewer recurrences than the
   reader, under per-token steps or an exit criterion). Like the public cache, when every
   position holds the index, everything is read there. Otherwise `lookup`:
   - "full" (the public default): only the positions that hold the index are read; the
     others drop out of that attention (the public "full" stacks the entries present,
     which is the same as its "skip").
   - "latest" (the public "latest-m4", with its hard-coded 2 prelude / 4 block layers made
     general): a missing position is read at the same block layer at its latest
     recurrence <= the reader's. Equals the Ouro oracle's LAST_EXITED, min(t, e_j).
   - "always-last" (the public "always-last-m4", made general): every position, present
     or not, is read at the same block layer at its latest recurrence overall (its final
     K/V: the Ouro oracle's SHARED, the reader's own position at its current step). As in
     the public file this applies only at an index where some position is missing; where
     all are present, all are read there.
   - "final" (not in the public file): like "always-last", but at every block index: each
     earlier position is read at the same block layer at its latest recurrence (its final
     K/V, earlier positions having finished), the reader's own at its current one. This is
     one shared K/V plane overwritten by every recurrence, computing one position at a
     time: the engine's SHARED layout.
   The public "compress-*" strategies (a ring of block-layer slots, overwritten by each
   recurrence) are not modelled. Token by token, they read like "always-last" applied at
   every index; the public vLLM plugin (`vllm/raven_vllm.py`, one attention layer per
   block layer) reads like them, and like "full" within one prompt chunk.
3. Prompt positions always run `num_steps` recurrences (the public adaptive generator's
   `do_not_exit_in_prefill=True`); exit criteria apply to decode inputs only. The public
   adaptive path runs the whole prompt as one chunk and would test the criterion on the
   mean over prompt positions; that is not modelled.
4. Exit criteria (the public `LatentDiffExitEvaluator` and `KLExitEvaluator`, reduce=True,
   one token): after recurrence r (1-based) with r - 1 >= min_steps, compute the value and
   exit if it is below the threshold; num_steps caps the depth.
   - "latent-diff": ||s_r - s_prev|| / ||s_r|| over the unnormalised state, s_prev the
     state at the previous check (s_0 before the first); default threshold 0.03.
   - "kl": KL(p_prev || p_r) of the next-token distributions from the coda applied to
     s_r, p_prev the previous check's (uniform over the vocabulary before the first);
     default threshold 1e-3.
   - "entropy-diff" (the public `EntropyDiffExitEvaluator`): |H_r - H_prev| of the
     next-token entropy -sum p log(p + 1e-10), H_prev the previous check's (100 before
     the first); default threshold 1e-3.
   The coda run for a check writes the position's coda K/V, which later checks overwrite;
   the values kept are those of the exit recurrence, which is what a recomputation from
   the exit state gives, so the oracle recomputes them once at the end.
5. `test_time_noise` must be 0 (the public default; otherwise the recurrence is random).
6. A tied checkpoint may carry `lm_head.weight` too (the published one stores both
   copies); it is ignored and the embedding is the head, as the tied model does. A stored
   `freqs_cis` buffer is ignored; RoPE is recomputed.
"""

import json
import math
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from statistics import NormalDist

import torch
from safetensors.torch import load_file

SOURCE_REPO = "seal-rg/recurrent-pretraining"
SOURCE_PATH = "recpre/raven_modeling_minimal.py"
SOURCE_COMMIT = "59e0b69b2d96a59cbbe79c9d5034d89ecb5ab6f6"

LOOKUP_STRATEGIES = ("full", "latest", "always-last", "final")
EXIT_CRITERIA = ("none", "latent-diff", "kl", "entropy-diff")
DEFAULT_EXIT_THRESHOLDS = {"latent-diff": 0.03, "kl": 1e-3, "entropy-diff": 1e-3}

# RavenConfig fields whose other values the public minimal model does not implement
_FIXED_FIELDS = {
    "injection_type": "linear",
    "state_init": "like-init",
    "block_class_name": "SandwichBlock",
    "norm_class_name": "RMSNorm_llama",
    "mlp_class_name": "GatedMLP",
    "nonlin_name": "SiLU",
}


@dataclass(frozen=True)
class HuginnConfig:
    """The RavenConfig fields the maths reads (config.json names in the comments)."""

    hidden_size: int  # n_embd
    num_heads: int  # n_heads (key/value heads: the same number)
    intermediate_size: int  # intermediate_size
    vocab_size: int  # vocab_size (= padded_vocab_size)
    num_prelude: int  # n_layers_in_prelude
    num_core: int  # n_layers_in_recurrent_block
    num_coda: int  # n_layers_in_coda
    mean_recurrence: int  # mean_recurrence: the default num_steps
    norm_eps: float  # norm_eps
    rope_base: float  # rope_base
    qk_bias: bool  # qk_bias
    adapter_bias: bool  # bias
    tie_embeddings: bool  # tie_embeddings
    block_size: int  # block_size: RoPE table length, the context limit

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def embed_scale(self) -> float:
        """Embeddings and the drawn initial state are multiplied by sqrt(n_embd)."""
        return math.sqrt(self.hidden_size)

    @property
    def state_std(self) -> float:
        """init_values["std"] of RavenConfig: sqrt(2 / (5 n_embd))."""
        return math.sqrt(2 / (5 * self.hidden_size))

    @classmethod
    def from_dict(cls, raw: dict) -> "HuginnConfig":
        for name, value in _FIXED_FIELDS.items():
            if raw.get(name, value) != value:
                raise ValueError(f"{name}={raw[name]!r} is not implemented (only {value!r})")
        if raw.get("test_time_noise", 0) not in (0, 0.0):
            raise ValueError("test_time_noise must be 0: the oracle is deterministic")
        heads = raw.get("n_heads", raw.get("num_attention_heads"))
        if heads is None:
            raise ValueError("config.json needs n_heads")
        kv_heads = raw.get("num_key_value_heads", heads)
        if kv_heads != heads:
            raise ValueError(f"num_key_value_heads ({kv_heads}) must equal n_heads ({heads})")
        hidden = raw.get("n_embd", raw.get("hidden_size"))
        if hidden is None or hidden % heads:
            raise ValueError(f"n_embd ({hidden}) must be a multiple of n_heads ({heads})")
        vocab = raw.get("vocab_size", 65536)
        padded = raw.get("padded_vocab_size", vocab)
        if padded != vocab:
            raise ValueError(f"padded_vocab_size ({padded}) must equal vocab_size ({vocab})")
        return cls(
            hidden_size=hidden,
            num_heads=heads,
            intermediate_size=raw.get("intermediate_size", 17920),
            vocab_size=vocab,
            num_prelude=raw.get("n_layers_in_prelude", 2),
            num_core=raw.get("n_layers_in_recurrent_block", 4),
            num_coda=raw.get("n_layers_in_coda", 2),
            mean_recurrence=raw.get("mean_recurrence", 32),
            norm_eps=raw.get("norm_eps", 1e-6),
            rope_base=float(raw.get("rope_base", 50_000)),
            qk_bias=raw.get("qk_bias", True),
            adapter_bias=raw.get("bias", False),
            tie_embeddings=raw.get("tie_embeddings", True),
            block_size=raw.get("block_size", 4096),
        )


def _expected_shapes(cfg: HuginnConfig) -> dict[str, tuple[int, ...]]:
    h, inter, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    shapes: dict[str, tuple[int, ...]] = {
        "transformer.wte.weight": (v, h),
        "transformer.adapter.weight": (h, 2 * h),
        "transformer.ln_f.weight": (h,),
    }
    if cfg.adapter_bias:
        shapes["transformer.adapter.bias"] = (h,)
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (v, h)
    stages = (("prelude", cfg.num_prelude), ("core_block", cfg.num_core), ("coda", cfg.num_coda))
    for stage, count in stages:
        for i in range(count):
            p = f"transformer.{stage}.{i}."
            for norm in ("norm_1", "norm_2", "norm_3", "norm_4"):
                shapes[p + norm + ".weight"] = (h,)
            shapes[p + "attn.Wqkv.weight"] = (3 * h, h)
            if cfg.qk_bias:
                shapes[p + "attn.qk_bias"] = (2, 1, cfg.num_heads, cfg.head_dim)
            shapes[p + "attn.proj.weight"] = (h, h)
            shapes[p + "mlp.fc.weight"] = (2 * inter, h)
            shapes[p + "mlp.proj.weight"] = (h, inter)
    return shapes


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        shards = ["model.safetensors"]
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        weights.update(load_file(str(folder / shard)))
    return weights


class HuginnModel:
    """Config and float32 weights of one checkpoint, with the per-row maths."""

    def __init__(self, config: HuginnConfig, weights: dict[str, torch.Tensor]) -> None:
        self.cfg = config
        expected = _expected_shapes(config)
        # ignored when present: the recomputed RoPE table, a tied head's second copy
        ignorable = {"freqs_cis"} | ({"lm_head.weight"} if config.tie_embeddings else set())
        missing = sorted(set(expected) - set(weights))
        unexpected = sorted(set(weights) - set(expected) - ignorable)
        if missing or unexpected:
            raise ValueError(f"checkpoint names: missing {missing}, unexpected {unexpected}")
        for name, shape in expected.items():
            if tuple(weights[name].shape) != shape:
                raise ValueError(f"{name}: shape {tuple(weights[name].shape)}, expected {shape}")
        self.w = {name: weights[name].to(torch.float32) for name in expected}
        head = "transformer.wte.weight" if config.tie_embeddings else "lm_head.weight"
        self.head_weight = self.w[head]

    @classmethod
    def from_folder(cls, folder: str | Path) -> "HuginnModel":
        """Load a Hugging Face Huginn folder (config.json + safetensors, sharded or not)."""
        folder = Path(folder)
        raw = json.loads((folder / "config.json").read_text())
        return cls(HuginnConfig.from_dict(raw), _read_safetensors(folder))

    # -- the maths of one layer, over rows x [n, hidden] ---------------------------------

    def rms_norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        scale = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.norm_eps)
        return x * scale * self.w[name]

    def rope(self, x: torch.Tensor, positions: list[int]) -> torch.Tensor:
        """Rotate the interleaved pairs (2i, 2i+1) of x [n, heads, d] by pos * theta_i."""
        d = self.cfg.head_dim
        theta = 1.0 / (self.cfg.rope_base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        angles = torch.tensor(positions, dtype=torch.float32)[:, None] * theta  # [n, d/2]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]  # [n, 1, d/2]
        even, odd = x[..., 0::2], x[..., 1::2]
        rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
        return rotated.flatten(-2)

    def qkv(
        self, prefix: str, x: torch.Tensor, positions: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (biased, rotated) and v, each [n, heads, d], of rows x [n, hidden]."""
        n, heads, d = x.shape[0], self.cfg.num_heads, self.cfg.head_dim
        a = self.rms_norm(x, prefix + "norm_1.weight")
        fused = a @ self.w[prefix + "attn.Wqkv.weight"].T  # [n, 3 * hidden]
        q, k, v = (part.reshape(n, heads, d) for part in fused.split(heads * d, dim=-1))
        if self.cfg.qk_bias:
            bias = self.w[prefix + "attn.qk_bias"]  # [2, 1, heads, d]
            q, k = q + bias[0], k + bias[1]
        return self.rope(q, positions), self.rope(k, positions), v

    def finish_layer(
        self,
        prefix: str,
        x: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Attention of q [n, heads, d] over k, v [m, heads, d] (mask [n, m], True = seen),
        then the rest of the sandwich block on rows x [n, hidden]."""
        scores = torch.einsum("nhd,mhd->hnm", q, k) / math.sqrt(self.cfg.head_dim)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        attn = torch.einsum("hnm,mhd->nhd", scores.softmax(-1), v).reshape(x.shape[0], -1)
        x = self.rms_norm(
            x + attn @ self.w[prefix + "attn.proj.weight"].T, prefix + "norm_2.weight"
        )
        b = self.rms_norm(x, prefix + "norm_3.weight")
        gate, up = (b @ self.w[prefix + "mlp.fc.weight"].T).chunk(2, dim=-1)
        mlp = (torch.nn.functional.silu(gate) * up) @ self.w[prefix + "mlp.proj.weight"].T
        return self.rms_norm(x + mlp, prefix + "norm_4.weight")

    # -- the stages ------------------------------------------------------------------------

    def embed(self, token_ids: list[int]) -> torch.Tensor:
        return self.w["transformer.wte.weight"][torch.tensor(token_ids)] * self.cfg.embed_scale

    def inject(self, state: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """The adapter over concat(state, prelude output): the start of every recurrence."""
        out = torch.cat([state, embedded], dim=-1) @ self.w["transformer.adapter.weight"].T
        if self.cfg.adapter_bias:
            out = out + self.w["transformer.adapter.bias"]
        return out

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self.rms_norm(x, "transformer.ln_f.weight")

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.head_weight.T

    def initial_state(self, position: int, init_scale: float, seed: int) -> torch.Tensor:
        """s_0 of one position: truncated normal (choice 1 in the module docstring)."""
        if seed < 0 or position < 0:
            raise ValueError(f"seed ({seed}) and position ({position}) must be >= 0")
        std = self.cfg.state_std * init_scale
        if std == 0:
            return torch.zeros(self.cfg.hidden_size)
        low = NormalDist().cdf(-3.0)
        values = [
            std * NormalDist().inv_cdf(low + u * (1 - 2 * low))
            for u in _state_uniforms(seed, position, self.cfg.hidden_size)
        ]
        return torch.tensor(values, dtype=torch.float64).float() * self.cfg.embed_scale


_MASK32 = 0xFFFFFFFF


def _mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & _MASK32
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & _MASK32
    return x ^ (x >> 16)


def _state_uniforms(seed: int, position: int, width: int) -> list[float]:
    """The uniforms of choice 1 in the module docstring, element by element."""
    stream = seed ^ 0x5EED57A7E0000001
    lo, hi = stream & _MASK32, (stream >> 32) & _MASK32
    base = _mix32(_mix32(lo ^ _mix32((hi + 0x9E3779B9) & _MASK32)) ^ (position & _MASK32))
    return [
        ((_mix32(base ^ _mix32(j + 0x632BE5AB)) >> 8) + 0.5) / float(1 << 24) for j in range(width)
    ]


def _layer_prefix(stage: str, index: int) -> str:
    return f"transformer.{stage}.{index}."


class HuginnCache:
    """Huginn's dynamic KV cache: entries[cache index][position] = (k, v), each [heads, d].

    Entries are written when computed; coda entries of a position may be rewritten (by an
    exit check), all others never are.
    """

    def __init__(self, cfg: HuginnConfig, lookup: str) -> None:
        if lookup not in LOOKUP_STRATEGIES:
            raise ValueError(f"lookup must be one of {LOOKUP_STRATEGIES}, got {lookup!r}")
        self.cfg = cfg
        self.lookup = lookup
        self.entries: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}

    def core_index(self, recurrence: int, layer: int) -> int:
        """Cache index of block layer `layer` at 0-based recurrence `recurrence`."""
        return self.cfg.num_prelude + recurrence * self.cfg.num_core + layer

    def write(self, index: int, position: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.entries.setdefault(index, {})[position] = (k, v)

    def _source_index(self, index: int, position: int, all_present: bool) -> int | None:
        """The index at which `position` is read by a query at `index` (None: skipped)."""
        present = position in self.entries[index]
        if self.lookup == "final" and index >= self.cfg.num_prelude:
            all_present = False  # read at the latest recurrence even where all hold it
        if all_present or self.lookup == "full" or index < self.cfg.num_prelude:
            # prelude and coda (negative) indices are held by every position
            return index if present else None
        recurrence, layer = divmod(index - self.cfg.num_prelude, self.cfg.num_core)
        held = [
            r
            for r in range(self.max_recurrences())
            if position in self.entries.get(self.core_index(r, layer), {})
        ]
        if self.lookup == "latest":
            held = [r for r in held if r <= recurrence]
        return self.core_index(max(held), layer)

    def max_recurrences(self) -> int:
        core = [i for i in self.entries if i >= self.cfg.num_prelude]
        return (max(core) - self.cfg.num_prelude) // self.cfg.num_core + 1 if core else 0

    def read(self, index: int, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [m, heads, d] that a query at `index` sees over positions 0..num_positions-1."""
        all_present = len(self.entries[index]) == num_positions
        keys, values = [], []
        for position in range(num_positions):
            source = self._source_index(index, position, all_present)
            if source is None:
                continue
            k, v = self.entries[source][position]
            keys.append(k)
            values.append(v)
        return torch.stack(keys), torch.stack(values)


@dataclass
class HuginnResult:
    """What one request produced; a "forwarded position" is one the model ran."""

    # generated tokens
    token_ids: list[int]
    # float32 [vocab] logits behind each generated token
    logits: list[torch.Tensor]
    # float32 [prompt_len, vocab]: the logits at every prompt position
    prompt_logits: torch.Tensor
    # recurrences run at each forwarded position
    steps: list[int] = field(default_factory=list)
    # per forwarded position: [steps + 1, hidden], s_0 then the state after each recurrence
    # (unnormalised: before ln_f)
    states: list[torch.Tensor] = field(default_factory=list)
    # per forwarded position: the exit criterion's value at each check (empty: no checks)
    exit_values: list[list[float]] = field(default_factory=list)


class _ExitCheck:
    """One decode input's exit test (the public evaluators, reduce=True, batch of one)."""

    def __init__(self, criterion: str, threshold: float, min_steps: int, vocab: int) -> None:
        self.criterion = criterion
        self.threshold = threshold
        self.min_steps = min_steps
        self.prev_state: torch.Tensor | None = None
        self.prev_log_probs = torch.full((vocab,), math.log(1 / vocab))
        self.prev_entropy = 100.0
        self.values: list[float] = []

    def start(self, state: torch.Tensor) -> None:
        self.prev_state = state.clone()

    def __call__(self, recurrence: int, state: torch.Tensor, coda: Callable) -> bool:
        """After the 1-based `recurrence`: exit now?"""
        if self.criterion == "none" or recurrence - 1 < self.min_steps:
            return False
        if self.criterion == "latent-diff":
            value = (state - self.prev_state).norm() / state.norm()
            self.prev_state = state.clone()
        elif self.criterion == "entropy-diff":
            probs = torch.softmax(coda(state), dim=-1)
            entropy = float(-(probs * torch.log(probs + 1e-10)).sum())
            value = abs(entropy - self.prev_entropy)
            self.prev_entropy = entropy
        else:
            log_probs = torch.log_softmax(coda(state), dim=-1)
            prev = self.prev_log_probs
            value = (prev.exp() * (prev - log_probs)).sum()
            self.prev_log_probs = log_probs
        self.values.append(float(value))
        return bool(value < self.threshold)


def _run_position(
    model: HuginnModel,
    cache: HuginnCache,
    position: int,
    token_id: int,
    initial: torch.Tensor,
    max_steps: int,
    check: _ExitCheck | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prelude, recurrences, coda of one position. Returns (logits [vocab], states)."""
    cfg = model.cfg
    positions = [position]

    def layer(prefix: str, index: int, x: torch.Tensor) -> torch.Tensor:
        q, k, v = model.qkv(prefix, x, positions)
        cache.write(index, position, k[0], v[0])
        k_seen, v_seen = cache.read(index, position + 1)
        return model.finish_layer(prefix, x, q, k_seen, v_seen, mask=None)

    def coda(state: torch.Tensor) -> torch.Tensor:
        x = model.final_norm(state)
        for i in range(cfg.num_coda):
            x = layer(_layer_prefix("coda", i), -(i + 1), x)
        return model.logits(model.final_norm(x))[0]

    embedded = model.embed([token_id])  # [1, hidden]
    for i in range(cfg.num_prelude):
        embedded = layer(_layer_prefix("prelude", i), i, embedded)

    state = initial[None, :]
    states = [state[0]]
    if check is not None:
        check.start(state)
    for recurrence in range(max_steps):
        state = model.inject(state, embedded)
        for i in range(cfg.num_core):
            state = layer(_layer_prefix("core_block", i), cache.core_index(recurrence, i), state)
        states.append(state[0])
        if check is not None and check(recurrence + 1, state, coda):
            break
    return coda(state), torch.stack(states)


def _check_args(
    model: HuginnModel,
    prompt_ids: list[int],
    max_tokens: int,
    num_steps: int,
    exit_criterion: str,
    min_steps: int,
    decode_steps: list[int] | None,
) -> None:
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    if any(not 0 <= t < model.cfg.vocab_size for t in prompt_ids):
        raise ValueError(f"prompt token ids must lie in [0, {model.cfg.vocab_size})")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if len(prompt_ids) + max_tokens - 1 > model.cfg.block_size:
        raise ValueError(f"prompt + max_tokens - 1 exceeds block_size {model.cfg.block_size}")
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if exit_criterion not in EXIT_CRITERIA:
        raise ValueError(f"exit_criterion must be one of {EXIT_CRITERIA}, got {exit_criterion!r}")
    if min_steps < 0:
        raise ValueError(f"min_steps must be >= 0, got {min_steps}")
    if decode_steps is not None:
        if exit_criterion != "none":
            raise ValueError("decode_steps replaces an exit criterion; give one, not both")
        if any(not 1 <= s <= num_steps for s in decode_steps):
            raise ValueError(f"decode_steps must lie in [1, {num_steps}]: {decode_steps}")


@torch.no_grad()
def huginn_generate(
    model: HuginnModel,
    prompt_ids: list[int],
    *,
    max_tokens: int,
    num_steps: int | None = None,
    init_scale: float = 1.0,
    seed: int = 0,
    lookup: str = "full",
    exit_criterion: str = "none",
    exit_threshold: float | None = None,
    min_steps: int = 0,
    decode_steps: list[int] | None = None,
    initial_state: Callable[[int], torch.Tensor] | None = None,
    eos_token_ids: AbstractSet[int] = frozenset(),
) -> HuginnResult:
    """Greedy generation of one request, token by token.

    num_steps (default: the config's mean_recurrence) is the depth of every prompt position
    and the cap for decode inputs; a decode input runs decode_steps[i] recurrences if given,
    else until `exit_criterion` fires. initial_state(position) overrides the drawn s_0.
    The last sampled token is never forwarded.
    """
    num_steps = model.cfg.mean_recurrence if num_steps is None else num_steps
    _check_args(model, prompt_ids, max_tokens, num_steps, exit_criterion, min_steps, decode_steps)
    if exit_threshold is None:
        exit_threshold = DEFAULT_EXIT_THRESHOLDS.get(exit_criterion, 0.0)
    cache = HuginnCache(model.cfg, lookup)
    result = HuginnResult(token_ids=[], logits=[], prompt_logits=torch.empty(0))

    def forward(position: int, token_id: int, steps: int, check: _ExitCheck | None) -> torch.Tensor:
        if initial_state is not None:
            s0 = initial_state(position).to(torch.float32)
        else:
            s0 = model.initial_state(position, init_scale, seed)
        logits, states = _run_position(model, cache, position, token_id, s0, steps, check)
        result.steps.append(states.shape[0] - 1)
        result.states.append(states)
        result.exit_values.append(check.values if check is not None else [])
        return logits

    prompt_logits = [forward(p, t, num_steps, None) for p, t in enumerate(prompt_ids)]
    result.prompt_logits = torch.stack(prompt_logits)
    logits = prompt_logits[-1]
    while True:
        token_id = int(torch.argmax(logits))
        result.token_ids.append(token_id)
        result.logits.append(logits)
        if len(result.token_ids) == max_tokens or token_id in eos_token_ids:
            return result
        decode_index = len(result.token_ids) - 1
        position = len(prompt_ids) + decode_index
        if decode_steps is not None:
            if decode_index >= len(decode_steps):
                raise ValueError(f"decode_steps has no depth for decode input {decode_index}")
            steps, check = decode_steps[decode_index], None
        else:
            steps = num_steps
            check = _ExitCheck(exit_criterion, exit_threshold, min_steps, model.cfg.vocab_size)
        logits = forward(position, token_id, steps, check)


@torch.no_grad()
def huginn_chunk_logits(
    model: HuginnModel,
    token_ids: list[int],
    initial_states: torch.Tensor,
    num_steps: int | None = None,
) -> torch.Tensor:
    """Cache-free forward of a whole sequence at a fixed depth with causal attention.

    initial_states: [len(token_ids), hidden]. Returns float32 logits [len(token_ids), vocab].
    With every position at the same depth, token-by-token generation must reproduce them.
    """
    cfg = model.cfg
    num_steps = cfg.mean_recurrence if num_steps is None else num_steps
    n = len(token_ids)
    positions = list(range(n))
    causal = torch.ones(n, n, dtype=torch.bool).tril()

    def layer(prefix: str, x: torch.Tensor) -> torch.Tensor:
        q, k, v = model.qkv(prefix, x, positions)
        return model.finish_layer(prefix, x, q, k, v, mask=causal)

    embedded = model.embed(token_ids)
    for i in range(cfg.num_prelude):
        embedded = layer(_layer_prefix("prelude", i), embedded)
    state = initial_states.to(torch.float32)
    for _ in range(num_steps):
        state = model.inject(state, embedded)
        for i in range(cfg.num_core):
            state = layer(_layer_prefix("core_block", i), state)
    x = model.final_norm(state)
    for i in range(cfg.num_coda):
        x = layer(_layer_prefix("coda", i), x)
    return model.logits(model.final_norm(x))
