"""Self-checks of the serial Huginn oracle (tests/reference/huginn_oracle.py) on a tiny
random checkpoint written with Huginn's config and tensor names."""

import json
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.reference.huginn_checkpoint import write_tiny_huginn
from tests.reference.huginn_oracle import (
    HuginnModel,
    huginn_chunk_logits,
    huginn_generate,
)

PROMPT = [5, 17, 42, 101, 7, 250]
STEPS = 8
# this checkpoint's recurrence settles within 8 steps, so the exit criteria fire at
# different depths for different tokens
CHECKPOINT_SEED = 5


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> HuginnModel:
    folder = tmp_path_factory.mktemp("huginn")
    write_tiny_huginn(folder, seed=CHECKPOINT_SEED)
    return HuginnModel.from_folder(folder)


@pytest.fixture(scope="module")
def generate(model: HuginnModel) -> partial:
    """huginn_generate bound to the tiny model at depth STEPS: generate(prompt, **kwargs)."""
    return partial(huginn_generate, model, num_steps=STEPS)


def _assert_same(a, b) -> None:
    assert a.token_ids == b.token_ids
    assert a.steps == b.steps
    torch.testing.assert_close(a.prompt_logits, b.prompt_logits, atol=0, rtol=0)
    for x, y in zip(a.logits + a.states, b.logits + b.states, strict=True):
        torch.testing.assert_close(x, y, atol=0, rtol=0)


def test_zero_init_scale_is_deterministic_and_starts_from_zero(generate: partial) -> None:
    first = generate(PROMPT, max_tokens=6, init_scale=0.0, seed=1)
    second = generate(PROMPT, max_tokens=6, init_scale=0.0, seed=2)  # the seed is unused
    _assert_same(first, second)
    assert all(not states[0].any() for states in first.states)
    assert first.steps == [STEPS] * (len(PROMPT) + 5)
    assert len(set(first.token_ids)) > 1


def test_seeded_init_is_reproducible_and_matters(generate: partial) -> None:
    a = generate(PROMPT, max_tokens=6, init_scale=1.0, seed=3)
    _assert_same(a, generate(PROMPT, max_tokens=6, init_scale=1.0, seed=3))
    assert all(states[0].any() for states in a.states)
    other_seed = generate(PROMPT, max_tokens=6, init_scale=1.0, seed=4)
    zero = generate(PROMPT, max_tokens=6, init_scale=0.0, seed=3)
    for other in (other_seed, zero):
        assert not torch.allclose(a.states[0][1], other.states[0][1], atol=1e-3)
        assert not torch.allclose(a.prompt_logits, other.prompt_logits, atol=1e-3)


def test_initial_state_is_a_truncated_normal_times_sqrt_hidden(model: HuginnModel) -> None:
    """std sqrt(2 / (5 n_embd)) * init_scale, cut at 3 std, times sqrt(n_embd)."""
    cfg = model.cfg
    draws = torch.stack([model.initial_state(p, 0.5, seed=0) for p in range(200)])
    bound = 3 * cfg.state_std * 0.5 * cfg.embed_scale
    assert float(draws.abs().max()) <= bound * (1 + 1e-6)
    # truncation at 3 sigma keeps 98.9% of the variance
    expected_std = cfg.state_std * 0.5 * cfg.embed_scale * 0.9867**0.5
    assert abs(float(draws.std()) / expected_std - 1) < 0.05
    assert not torch.equal(draws[0], draws[1])


def test_logits_do_not_depend_on_how_many_tokens_follow(generate: partial) -> None:
    for kwargs in ({"init_scale": 0.0}, {"init_scale": 1.0, "seed": 9}):
        short = generate(PROMPT, max_tokens=2, **kwargs)
        long = generate(PROMPT, max_tokens=7, **kwargs)
        assert long.token_ids[:2] == short.token_ids
        torch.testing.assert_close(long.prompt_logits, short.prompt_logits, atol=0, rtol=0)
        for x, y in zip(short.logits, long.logits[:2], strict=True):
            torch.testing.assert_close(x, y, atol=0, rtol=0)


@pytest.mark.parametrize("init_scale", [0.0, 1.0])
def test_one_chunk_equals_token_by_token(model: HuginnModel, init_scale: float) -> None:
    """At one depth for every position, a causal forward of the whole sequence at once (no
    cache) gives the logits that token-by-token generation produced, for every lookup."""
    out = huginn_generate(
        model, PROMPT, max_tokens=5, num_steps=STEPS, init_scale=init_scale, seed=2
    )
    sequence = PROMPT + out.token_ids[:-1]
    states = torch.stack([model.initial_state(p, init_scale, 2) for p in range(len(sequence))])
    dense = huginn_chunk_logits(model, sequence, states, num_steps=STEPS)
    # float32, summed in another order: logits of size ~3 agree to ~1e-5
    torch.testing.assert_close(dense[: len(PROMPT)], out.prompt_logits, atol=1e-4, rtol=0)
    for i, logits in enumerate(out.logits):
        torch.testing.assert_close(dense[len(PROMPT) - 1 + i], logits, atol=1e-4, rtol=0)
    for lookup in ("latest", "always-last"):
        same = huginn_generate(
            model, PROMPT, max_tokens=5, num_steps=STEPS, init_scale=init_scale, seed=2,
            lookup=lookup,
        )  # fmt: skip
        _assert_same(same, out)


def test_lookups_differ_only_once_a_position_misses_a_step(generate: partial) -> None:
    """With decode inputs at different depths, a deeper token finds earlier ones missing
    steps, and the three lookups disagree from there on, never before: "full" leaves them
    out, "latest" reads them at their latest step <= the reader's, "always-last" reads every
    position (the 8-step prompt too) at its last step."""
    depths = [2, 8, 3, 8]
    runs = {
        lookup: generate(PROMPT, max_tokens=5, init_scale=0.0, lookup=lookup, decode_steps=depths)
        for lookup in ("full", "latest", "always-last")
    }
    full, latest, last = runs["full"], runs["latest"], runs["always-last"]
    # the first two logits come from inputs that find every step they read
    for run in (latest, last):
        for i in (0, 1):
            torch.testing.assert_close(run.logits[i], full.logits[i], atol=0, rtol=0)
    # the 8-step input after a 2-step one reads steps 3..8 the 2-step one never ran
    for a, b in ((latest, full), (last, full), (latest, last)):
        assert not torch.allclose(a.logits[2], b.logits[2], atol=1e-4)


@pytest.mark.parametrize("criterion, threshold", [("latent-diff", 0.5), ("kl", 0.05)])
def test_exit_criteria_vary_depth_and_replay_as_decode_steps(
    generate: partial, criterion: str, threshold: float
) -> None:
    out = generate(
        PROMPT, max_tokens=8, init_scale=0.0, exit_criterion=criterion, exit_threshold=threshold
    )
    decode = out.steps[len(PROMPT) :]
    assert out.steps[: len(PROMPT)] == [STEPS] * len(PROMPT)
    assert len(set(decode)) > 1 and all(1 <= s <= STEPS for s in decode)
    for steps, values in zip(decode, out.exit_values[len(PROMPT) :], strict=True):
        # exit at the first value under the threshold, or at the cap
        assert len(values) == steps
        assert all(v >= threshold for v in values[:-1])
        assert values[-1] < threshold or steps == STEPS
    replay = generate(PROMPT, max_tokens=8, init_scale=0.0, decode_steps=decode)
    _assert_same(replay, out)


def test_latent_diff_is_the_relative_change_of_the_state(generate: partial) -> None:
    out = generate(PROMPT, max_tokens=3, init_scale=1.0, exit_criterion="latent-diff")
    for states, values in zip(
        out.states[len(PROMPT) :], out.exit_values[len(PROMPT) :], strict=True
    ):
        change = (states[1:] - states[:-1]).norm(dim=-1) / states[1:].norm(dim=-1)
        torch.testing.assert_close(torch.tensor(values), change[: len(values)])


def test_min_steps_delays_the_first_check(generate: partial) -> None:
    out = generate(
        PROMPT, max_tokens=4, init_scale=0.0, exit_criterion="kl", exit_threshold=10.0,
        min_steps=3,
    )  # fmt: skip
    # a threshold every value passes: exit at the first check, after min_steps + 1 steps
    assert out.steps[len(PROMPT) :] == [4, 4, 4]


def test_tied_head_with_or_without_stored_copy(tmp_path: Path) -> None:
    write_tiny_huginn(tmp_path / "both", seed=1)
    write_tiny_huginn(tmp_path / "embed_only", seed=1, drop_tied_head=True)
    a = huginn_generate(HuginnModel.from_folder(tmp_path / "both"), PROMPT, max_tokens=3)
    b = huginn_generate(HuginnModel.from_folder(tmp_path / "embed_only"), PROMPT, max_tokens=3)
    _assert_same(a, b)


def test_untied_head_is_read(tmp_path: Path) -> None:
    write_tiny_huginn(tmp_path / "tied", seed=1, drop_tied_head=True)
    folder = tmp_path / "untied"
    write_tiny_huginn(folder, seed=1, overrides={"tie_embeddings": False})
    weights = load_file(str(folder / "model.safetensors"))
    weights["lm_head.weight"] = -weights["transformer.wte.weight"]
    save_file(weights, str(folder / "model.safetensors"))
    tied = huginn_generate(HuginnModel.from_folder(tmp_path / "tied"), PROMPT, max_tokens=1)
    untied = huginn_generate(HuginnModel.from_folder(folder), PROMPT, max_tokens=1)
    torch.testing.assert_close(untied.logits[0], -tied.logits[0])


def test_checkpoint_names_shapes_and_config_are_checked(tmp_path: Path) -> None:
    write_tiny_huginn(tmp_path, seed=1)
    weights = load_file(str(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    cfg_ok = HuginnModel.from_folder(tmp_path).cfg
    renamed = dict(weights)
    renamed["transformer.adapter.weights"] = renamed.pop("transformer.adapter.weight")
    with pytest.raises(ValueError, match="transformer.adapter.weight"):
        HuginnModel(cfg_ok, renamed)
    reshaped = dict(weights)
    reshaped["transformer.core_block.0.attn.qk_bias"] = torch.zeros(2, 4, 16)
    with pytest.raises(ValueError, match="qk_bias"):
        HuginnModel(cfg_ok, reshaped)
    for field, value in (("injection_type", "add"), ("num_key_value_heads", 2)):
        (tmp_path / "config.json").write_text(json.dumps({**config, field: value}))
        with pytest.raises(ValueError, match=field):
            HuginnModel.from_folder(tmp_path)


def test_bad_arguments_are_refused(generate: partial) -> None:
    with pytest.raises(ValueError, match="lookup"):
        generate(PROMPT, max_tokens=2, lookup="latest-m4")
    with pytest.raises(ValueError, match="decode_steps"):
        generate(PROMPT, max_tokens=3, decode_steps=[STEPS + 1, 1])
    with pytest.raises(ValueError, match="exit_criterion"):
        generate(PROMPT, max_tokens=2, exit_criterion="entropy")
    with pytest.raises(ValueError, match="num_steps"):
        generate(PROMPT, max_tokens=2, num_steps=0)
