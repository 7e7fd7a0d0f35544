"""Training data and the trainable model agree with the engine (CPU smoke scale)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from vllm_rlt import LLM, SamplingParams
from vllm_rlt.models.load import DEFAULT_MODEL_DIR
from vllm_rlt.training.data import TASKS, TRAIN_SEED, held_out, problems
from vllm_rlt.training.model import exit_distribution
from vllm_rlt.training.train import main


def test_problems_are_deterministic_checkable_and_held_out_sets_are_disjoint():
    for task in TASKS:
        first = problems(task, 50, TRAIN_SEED)
        assert first == problems(task, 50, TRAIN_SEED)
        assert len({prompt for prompt, _ in first}) == 50
        evaluation = held_out(task, 30, first)
        assert not {p for p, _ in evaluation} & {p for p, _ in first}
    prompt, answer = problems("add", 1, 7)[0]
    a, b = prompt.rstrip("=").split("+")
    assert int(a) + int(b) == int(answer)
    with pytest.raises(ValueError, match="task must be one of"):
        problems("divide", 1, 0)


def test_exit_distribution_sums_to_one_and_ignores_the_last_hazard():
    hazards = torch.tensor([[0.3], [0.5], [0.2], [0.9]])
    probs = exit_distribution(hazards)
    assert torch.allclose(probs.sum(0), torch.ones(1))
    expected = torch.tensor([[0.3], [0.7 * 0.5], [0.7 * 0.5 * 0.2], [0.7 * 0.5 * 0.8]])
    assert torch.allclose(probs, expected)


def test_smoke_training_saves_a_folder_the_engine_reproduces(tmp_path, capsys):
    """The trained weights load through the strict loader, and the engine's fixed-depth
    greedy tokens equal the training model's own greedy decode. Progress (steps and loss)
    goes to stderr, leaving stdout to the result."""
    out = tmp_path / "trained"
    assert main(["--out", str(out), "--smoke", "--device", "cpu"]) == 0
    printed = capsys.readouterr()
    assert "stage1" in printed.err and "20/20" in printed.err and "loss=" in printed.err
    assert "5/5" in printed.err and "exact match" in printed.err
    assert "exact_match_full_depth" in json.loads(printed.out)
    record = json.loads((out / "training_record.json").read_text())
    assert set(record["exact_match_full_depth"]) == set(TASKS)
    # the folder is shaped like the built-in model's: bare-prompt chat, greedy by default
    for name in ("tokenizer_config.json", "generation_config.json"):
        assert json.loads((out / name).read_text()) == json.loads(
            (DEFAULT_MODEL_DIR / name).read_text()
        )
    assert record["stages"]["stage1"]["steps"] == 20
    from safetensors.torch import load_file

    from vllm_rlt.models.ouro import OuroConfig
    from vllm_rlt.training.model import TrainableOuro

    config = OuroConfig.from_dict(json.loads((out / "config.json").read_text()))
    model = TrainableOuro(config)
    model.load_state_dict(load_file(str(out / "model.safetensors")))
    prompt = "347+589="
    ids = [3 + b for b in prompt.encode()]
    llm = LLM(model=str(out))
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2)
    completion = llm.generate([ids], params, use_tqdm=False)[0].outputs[0]
    sequence = ids + completion.token_ids[:-1]
    with torch.no_grad():
        logits, _ = model(torch.tensor([sequence]))
    expected = logits[-1, 0, len(ids) - 1 :].log_softmax(-1)
    for step, token in enumerate(completion.token_ids):
        assert token == int(expected[step].argmax())
        assert completion.logprobs[step][token].logprob == pytest.approx(
            float(expected[step, token]), abs=1e-4
        )


def test_accuracy_benchmark_runs_through_the_engine(tmp_path, capsys):
    from vllm_rlt.bench.accuracy import main as accuracy

    out = tmp_path / "trained"
    assert main(["--out", str(out), "--smoke", "--device", "cpu"]) == 0
    capsys.readouterr()
    assert accuracy(["--model", str(out), "--per-task", "2", "--thresholds", "0.5"]) == 0
    report = json.loads(capsys.readouterr().out)
    settings = [row["setting"] for row in report["rows"]]
    assert settings == ["depth 1", "depth 2", "depth 3", "depth 4", "ouro q=0.5"]
    assert report["rows"][0]["mean_loops"] == 1.0
    assert all(set(row["exact_match"]) == set(TASKS) for row in report["rows"])


def test_huginn_smoke_training_saves_a_folder_the_engine_and_oracle_agree_on(tmp_path, capsys):
    """`--family huginn` trains the prelude / recurrent block / coda outline and saves a
    Huginn checkpoint (RavenConfig names, tied head) that loads through the strict loader:
    the engine equals the serial oracle on it, and the training model's maths equals the
    oracle's at a zero initial state."""
    from safetensors.torch import load_file

    from tests.reference.huginn_match import assert_matches_oracle
    from tests.reference.huginn_oracle import HuginnModel, huginn_generate
    from vllm_rlt.models.huginn_config import HuginnConfig
    from vllm_rlt.training.huginn_model import TrainableHuginn

    out = tmp_path / "trained"
    assert main(["--family", "huginn", "--out", str(out), "--smoke", "--device", "cpu"]) == 0
    printed = capsys.readouterr()
    assert "stage1" in printed.err and "20/20" in printed.err and "stage2" not in printed.err
    record = json.loads((out / "training_record.json").read_text())
    assert set(record["exact_match_full_depth"]) == set(TASKS)
    raw = json.loads((out / "config.json").read_text())
    assert raw["architectures"] == ["RavenForCausalLM"]
    config = HuginnConfig.from_dict(raw)
    assert config.num_loops == 4 and config.tie_word_embeddings

    oracle = HuginnModel.from_folder(out)
    ids = [3 + b for b in b"347+589="]
    llm = LLM(model=str(out), dtype="float32")
    params = SamplingParams(max_tokens=4, temperature=0.0, seed=4, ignore_eos=True, logprobs=2)
    completion = llm.generate([ids], params, use_tqdm=False)[0].outputs[0]
    want = huginn_generate(oracle, ids, max_tokens=4, seed=4, lookup="latest")
    assert_matches_oracle(completion, want, len(ids), atol=1e-4)

    model = TrainableHuginn(config)
    model.load_state_dict(load_file(str(out / "model.safetensors")))
    with torch.no_grad():
        logits = model(torch.tensor([ids]), noise=False)[0][-1, 0, -1]
    zero = huginn_generate(oracle, ids, max_tokens=1, init_scale=0.0)
    assert torch.allclose(logits.log_softmax(-1), zero.logits[0].log_softmax(-1), atol=1e-5)


def test_bench_accuracy_reads_a_huginn_model_at_fixed_depths_and_latent_thresholds(tmp_path):
    """`bench accuracy` on a Huginn-shaped model: every fixed depth runs exactly that many
    loops, and its default thresholds are the latent criterion's, whose mean loops fall
    as the threshold rises."""
    from vllm_rlt.bench.accuracy import THRESHOLDS, run

    out = tmp_path / "trained"
    assert main(["--family", "huginn", "--out", str(out), "--smoke", "--device", "cpu"]) == 0
    args = argparse.Namespace(
        model=str(out),
        device="cpu",
        dtype="float32",
        kv_layout="last_exited",
        per_task=2,
        train_size=200,
        thresholds=None,
        write_lm_eval_data=None,
        speculative_tokens=None,
        draft_loops=2,
        quantization=None,
        kv_cache_dtype="auto",
    )
    rows = run(args)["rows"]
    fixed = {row["setting"]: row["mean_loops"] for row in rows[:4]}
    assert fixed == {f"depth {d}": float(d) for d in range(1, 5)}
    latent = rows[4:]
    expected = [f"latent_diff q={q}" for q in THRESHOLDS["latent_diff"]]
    assert [row["setting"] for row in latent] == expected
    assert latent[0]["mean_loops"] <= latent[-1]["mean_loops"]
