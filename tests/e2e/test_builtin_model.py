"""The shipped default model (ouro-tasks) through the engine: it answers held-out problems, its
trained gate makes exit depths vary, and the loops matter."""

from __future__ import annotations

import json

import pytest

from vllm_rlt import LLM, SamplingParams
from vllm_rlt.entrypoints.cli import main
from vllm_rlt.models.load import DEFAULT_MODEL_DIR, DEFAULT_MODEL_NAME
from vllm_rlt.training.data import TASKS, held_out, training_set

# The accuracy stated in docs/benchmarks/2026-11-30-ouro-tasks.md is 100% on 200 held-out
# problems per task at full depth and at the default threshold; 95% leaves room for a
# different CPU's rounding without letting a broken model through.
STATED_ACCURACY = 0.95


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()


@pytest.fixture(scope="module")
def sample() -> list[tuple[str, str]]:
    """100 held-out problems, spread over the tasks, disjoint from the training set."""
    record = json.loads((DEFAULT_MODEL_DIR / "training_record.json").read_text())
    train_size = record["args"]["train_size"]
    per_task = -(-100 // len(TASKS))
    problems = [
        p for task in TASKS for p in held_out(task, per_task, training_set(task, train_size))
    ]
    return problems[:100]


def run_tasks(llm: LLM, problems, **params) -> tuple[float, list[int]]:
    sampling = SamplingParams(max_tokens=12, temperature=0.0, **params)
    outputs = llm.generate([p for p, _ in problems], sampling, use_tqdm=False)
    assert llm.engine.all_blocks_free()
    answers = [answer for _, answer in problems]
    correct = sum(o.outputs[0].text == a for o, a in zip(outputs, answers, strict=True))
    depths = [d for o in outputs for d in o.outputs[0].exit_depths[1:]]  # decode tokens
    return correct / len(problems), depths


def test_default_model_is_the_trained_one(llm):
    assert llm.model_name == DEFAULT_MODEL_NAME
    assert llm.engine.model.config.num_loops == 4
    assert (DEFAULT_MODEL_DIR / "model.safetensors").stat().st_size <= 20 * 2**20


def test_held_out_accuracy_with_the_trained_gate(llm, sample):
    accuracy, depths = run_tasks(llm, sample)  # the shipped config's exit threshold
    assert accuracy >= STATED_ACCURACY
    assert len(set(depths)) >= 2, "the trained gate should stop tokens at different depths"
    assert sum(depths) / len(depths) <= 3.0


def test_loops_matter(llm, sample):
    full, _ = run_tasks(llm, sample, max_loops=4, exit_threshold=1.0)
    one, depths = run_tasks(llm, sample, max_loops=1, exit_threshold=1.0)
    assert set(depths) == {1}
    assert full >= STATED_ACCURACY
    assert one <= full - 0.3


def test_first_command_prints_a_correct_answer(capsys):
    assert main(["generate", "--prompt", "347+589=", "--no-progress"]) == 0
    assert capsys.readouterr().out.strip() == "347+589=936"
