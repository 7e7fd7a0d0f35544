"""Huginn's config.json parsing: the published config's sizes, each refused setting named,
and the K/V planes of its stages; the vector state the Huginn exit policies carry."""

from __future__ import annotations

import pytest
import torch

from tests.reference.huginn_checkpoint import TINY_CONFIG
from vllm_rlt.bench.shapes import SHAPES
from vllm_rlt.config import ExitConfig
from vllm_rlt.exit.kl import KLPolicy
from vllm_rlt.exit.latent_diff import LatentDiffPolicy
from vllm_rlt.exit.policy import ExitInputs
from vllm_rlt.exit.registry import make_exit_policy
from vllm_rlt.models.huginn_config import HuginnConfig


def test_the_published_shape():
    cfg = HuginnConfig.from_dict(SHAPES["huginn-3.5b"]())
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim) == (5280, 55, 96)
    assert (cfg.num_loops, cfg.num_hidden_layers, cfg.tie_word_embeddings) == (32, 8, True)
    assert cfg.kv_planes(32) == (1, 1, 32, 32, 32, 32, 1, 1)
    assert cfg.kv_planes(1) == (1,) * 8
    shapes = cfg.checkpoint_shapes()
    assert shapes["transformer.core_block.3.attn.qk_bias"] == (2, 1, 55, 96)
    assert "lm_head.weight" not in shapes and cfg.optional_tensors() == {"lm_head.weight"}
    params = sum(torch.Size(s).numel() for s in shapes.values())
    assert 3.5e9 < params < 3.6e9


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"injection_type": "add"}, "injection_type"),
        ({"state_init": "zero"}, "state_init"),
        ({"test_time_noise": 0.1}, "test_time_noise"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"n_embd": 66}, "n_embd / n_heads"),
        ({"padded_vocab_size": 512}, "padded_vocab_size"),
        ({"n_layers": 9}, "n_layers"),
        ({"mean_recurrence": 0}, "mean_recurrence"),
        ({"init_scale": -1.0}, "init_scale"),
        ({"norm_eps": float("nan")}, "norm_eps"),
        ({"surprise": 1}, "surprise"),
    ],
)
def test_unsupported_settings_are_refused_by_name(change, message):
    with pytest.raises(ValueError, match=message):
        HuginnConfig.from_dict({**TINY_CONFIG, **change})


def test_auto_mode_picks_the_model_family_policy():
    model = type("M", (), {"exit_policy": "latent_diff", "initial_state": None})()
    model.config = HuginnConfig.from_dict(TINY_CONFIG)
    assert isinstance(make_exit_policy(ExitConfig(), model), LatentDiffPolicy)
    assert isinstance(make_exit_policy(ExitConfig(mode="kl"), model), KLPolicy)


def _inputs(hidden, loops_done, carried, logits=None, threshold=0.5, min_loops=1):
    rows = hidden.shape[0]
    return ExitInputs(
        hidden=hidden,
        slots=torch.arange(rows),
        num_generated=torch.ones(rows, dtype=torch.int64),
        loops_done=torch.tensor(loops_done),
        min_loops=torch.full((rows,), min_loops),
        max_loops=torch.full((rows,), 8),
        exit_threshold=torch.full((rows,), threshold),
        carried=carried,
        positions=torch.arange(rows),
        seeds=torch.zeros(rows, dtype=torch.int64),
        logits=logits,
    )


def test_latent_diff_compares_with_the_last_check_and_restarts_per_token():
    start = torch.ones(2, 4)
    policy = LatentDiffPolicy(4, lambda seeds, positions: start[: seeds.shape[0]])
    policy.bind(2, torch.device("cpu"))
    slots = torch.arange(2)
    # first loop: against the initial state; the second row's change is small
    state = torch.stack([torch.full((4,), 3.0), torch.full((4,), 1.1)])
    decision = policy.decide(_inputs(state, [1, 1], policy.gather(slots)))
    assert decision.exit.tolist() == [False, True]
    policy.store(slots, decision.carried, decision.exit)
    assert torch.equal(policy.carried["reference"][0], state[0])
    # the next loop of row 0 compares with its last check: no change, so it exits
    decision = policy.decide(_inputs(state[:1], [2], policy.gather(slots[:1])))
    assert decision.exit.tolist() == [True]


def test_kl_starts_from_uniform_and_never_exits_at_threshold_zero():
    policy = KLPolicy(5)
    policy.bind(1, torch.device("cpu"))
    uniform = torch.zeros(1, 5)
    carried = policy.gather(torch.arange(1))
    assert carried["reference"].shape == (1, 5)
    exits = policy.decide(_inputs(torch.ones(1, 3), [1], carried, uniform, threshold=1e-6))
    assert exits.exit.tolist() == [True]  # KL(uniform || uniform) = 0
    never = policy.decide(_inputs(torch.ones(1, 3), [1], carried, uniform, threshold=0.0))
    assert never.exit.tolist() == [False]


def test_a_token_streams_the_block_every_loop_and_the_rest_once():
    """The roofline's bytes: adapter and block per loop; prelude, coda and head once."""
    from types import SimpleNamespace

    from tests.reference.huginn_checkpoint import tiny_huginn_weights
    from vllm_rlt.bench.device_figures import roofline
    from vllm_rlt.models.huginn import HuginnModel

    cfg = HuginnConfig.from_dict(TINY_CONFIG)
    model = HuginnModel(cfg, tiny_huginn_weights(TINY_CONFIG), torch.float32, "cpu")
    h, inter, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    layer = 4 * (3 * h * h + h * h + 2 * inter * h + h * inter)
    looped, once, looped_layers, once_layers = model.streamed_bytes()
    assert looped == 4 * layer + 4 * 2 * h * h  # four block layers and the adapter
    assert once == 4 * layer + 4 * vocab * h  # two prelude, two coda layers, the head
    assert (looped_layers, once_layers) == (4, 4)
    args = SimpleNamespace(kv_cache_dtype="auto", shared_prefix_len=0, prompt_len=10, output_len=0)
    bound = roofline(model, args, 1, 8.0, 1e9)
    kv_layer = 10 * 2 * h * 4
    per_token = 8 * (looped + 4 * kv_layer) + once + 4 * kv_layer
    assert bound["decode_tokens_per_s_bound"] == pytest.approx(1e9 / per_token)
