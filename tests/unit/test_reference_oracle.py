"""Self-checks of the serial oracle (tests/reference) on a tiny random Ouro model."""

from functools import partial

import pytest
import torch

from tests.reference.oracle import reference_dense_logits, reference_generate

CONFIG = {
    "vocab_size": 259,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "total_ut_steps": 4,
}
T = CONFIG["total_ut_steps"]
PROMPT = [5, 17, 42, 101, 7]
NORMS = (
    "input_layernorm",
    "input_layernorm_2",
    "post_attention_layernorm",
    "post_attention_layernorm_2",
)


def _tiny_weights() -> dict[str, torch.Tensor]:
    """Seeded float32 weights; the gate is wide so that hazards vary across tokens."""
    gen = torch.Generator().manual_seed(0)
    hidden, inter = CONFIG["hidden_size"], CONFIG["intermediate_size"]
    vocab = CONFIG["vocab_size"]
    q_dim = CONFIG["num_attention_heads"] * CONFIG["head_dim"]
    kv_dim = CONFIG["num_key_value_heads"] * CONFIG["head_dim"]

    def rand(*shape: int, std: float = 0.1) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    w = {
        "model.embed_tokens.weight": rand(vocab, hidden),
        "lm_head.weight": rand(vocab, hidden),
        "model.norm.weight": 1.0 + rand(hidden),
        "model.early_exit_gate.weight": rand(1, hidden, std=0.3),
        "model.early_exit_gate.bias": torch.zeros(1),
    }
    for layer in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        w[p + "self_attn.q_proj.weight"] = rand(q_dim, hidden)
        w[p + "self_attn.k_proj.weight"] = rand(kv_dim, hidden)
        w[p + "self_attn.v_proj.weight"] = rand(kv_dim, hidden)
        w[p + "self_attn.o_proj.weight"] = rand(hidden, q_dim)
        w[p + "mlp.gate_proj.weight"] = rand(inter, hidden)
        w[p + "mlp.up_proj.weight"] = rand(inter, hidden)
        w[p + "mlp.down_proj.weight"] = rand(hidden, inter)
        for name in NORMS:
            w[p + name + ".weight"] = 1.0 + rand(hidden)
    return w


@pytest.fixture(scope="module")
def generate() -> partial:
    """reference_generate bound to the tiny model: generate(prompt_ids, **kwargs)."""
    return partial(reference_generate, CONFIG, _tiny_weights())


def test_fixed_depth_last_exited_matches_dense_forward() -> None:
    """docs/design.md §6: at fixed depth, LAST_EXITED equals a cache-free full forward."""
    weights = _tiny_weights()
    out = reference_generate(CONFIG, weights, PROMPT, max_tokens=8)
    assert out.exit_depths == [T] * 8
    dense = reference_dense_logits(CONFIG, weights, PROMPT + out.token_ids[:-1])
    for i, logits in enumerate(out.logits):
        expected = dense[len(PROMPT) - 1 + i]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)
        assert out.token_ids[i] == int(expected.argmax())


def test_layouts_agree_until_an_earlier_token_is_read(generate: partial) -> None:
    """A 1-token prompt reads nothing earlier: the layouts agree on token 1 only."""
    last = generate([9], max_tokens=2, layout="last_exited")
    shared = generate([9], max_tokens=2, layout="shared")
    torch.testing.assert_close(shared.logits[0], last.logits[0], atol=0, rtol=0)
    assert not torch.allclose(shared.logits[1], last.logits[1])


def test_shared_decode_prefills_like_last_exited_and_decodes_like_shared(generate) -> None:
    """SHARED_DECODE (docs/design.md §3.3): the first token equals LAST_EXITED's bit for bit
    (the prompt computes the same); a decode token reads every earlier position at its
    final K/V, as SHARED does, which differs from LAST_EXITED's min(t, e_j)."""
    last = generate(PROMPT, max_tokens=4, layout="last_exited")
    decode_shared = generate(PROMPT, max_tokens=4, layout="shared_decode")
    shared = generate(PROMPT, max_tokens=4, layout="shared")
    torch.testing.assert_close(decode_shared.logits[0], last.logits[0], atol=0, rtol=0)
    assert not torch.allclose(decode_shared.logits[0], shared.logits[0])  # prompt differs
    assert not torch.allclose(decode_shared.logits[1], last.logits[1])  # decode differs


def test_ouro_threshold_depths_vary_within_bounds(generate: partial) -> None:
    out = generate(PROMPT, max_tokens=16, exit_threshold=0.5, min_loops=2)
    decode_depths = out.exit_depths[1:]
    assert out.exit_depths[0] == T
    # K/V never computed (beyond a token's exit depth) is NaN, so this shows that
    # no read went past min(t, e_j).
    assert all(bool(torch.isfinite(logits).all()) for logits in out.logits)
    assert all(2 <= d <= T for d in decode_depths)
    assert len(set(decode_depths)) > 1


def test_ouro_delayed_exits_one_loop_after_the_trigger(generate: partial) -> None:
    """The first decode input sees the same context under both policies, so its
    depths relate exactly: delayed = min(ouro + 1, max_loops)."""
    seen = set()
    for first in range(12):
        prompt = [first, 3 * first + 1, 50]
        kwargs = {"max_tokens": 2, "exit_threshold": 0.7, "max_loops": 3}
        ouro = generate(prompt, **kwargs)
        delayed = generate(prompt, exit_mode="ouro_delayed", **kwargs)
        assert delayed.exit_depths[1] == min(ouro.exit_depths[1] + 1, 3)
        seen.add(ouro.exit_depths[1])
    assert seen == {1, 2, 3}
    long = generate(PROMPT, max_tokens=12, exit_mode="ouro_delayed", exit_threshold=0.5)
    assert all(d >= 2 for d in long.exit_depths[1:])


def test_trace_replays_depths(generate: partial) -> None:
    """Replaying an ouro run's depths as a trace reproduces the run exactly."""
    ouro = generate(PROMPT, max_tokens=10, exit_threshold=0.5)
    assert len(set(ouro.exit_depths)) > 1
    replay = generate(PROMPT, max_tokens=10, exit_mode="trace", trace=ouro.exit_depths)
    assert replay.exit_depths == ouro.exit_depths
    assert replay.token_ids == ouro.token_ids
    for a, b in zip(replay.logits, ouro.logits, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    trace = [T, 1, 3, 2, 4, 1]
    out = generate(PROMPT, max_tokens=6, exit_mode="trace", trace=trace)
    assert out.exit_depths == trace


def test_eos_stops_after_min_tokens_unless_ignored(generate: partial) -> None:
    full = generate(PROMPT, max_tokens=8)
    eos = full.token_ids[2]

    def expected_stop(min_tokens: int) -> list[int]:
        """Tokens up to the first EOS that is at least the min_tokens-th token."""
        for i, token in enumerate(full.token_ids):
            if token == eos and i + 1 >= min_tokens:
                return full.token_ids[: i + 1]
        raise AssertionError("no EOS late enough")

    stopped = generate(PROMPT, max_tokens=8, eos_token_ids={eos})
    assert stopped.token_ids == expected_stop(0)
    first_eos = len(stopped.token_ids)
    late = generate(PROMPT, max_tokens=8, eos_token_ids={eos}, min_tokens=first_eos + 1)
    assert late.token_ids == expected_stop(first_eos + 1)
    ignored = generate(PROMPT, max_tokens=8, eos_token_ids={eos}, ignore_eos=True)
    assert ignored.token_ids == full.token_ids
