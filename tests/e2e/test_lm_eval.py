"""lm-evaluation-harness end to end: `lm_eval --model local-completions` against a live
`vllm-rlt serve` of the built-in model, on the tasks in benchmarks/lm_eval/ (its held-out
problems, no download), gives the accuracies `vllm-rlt bench accuracy` gives: generation by
exact match at the default exit threshold and at depth 1, and multiple choice by
loglikelihood (echo + logprobs prompt scoring)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server.conftest import _free_port, wait_healthy
from vllm_rlt.bench.accuracy import documents, run
from vllm_rlt.training.data import TASKS

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "benchmarks" / "lm_eval" / "ouro_tasks.jsonl"
PER_TASK = 20
TASK_NAMES = ("ouro_tasks_generate", "ouro_tasks_generate_depth1", "ouro_tasks_choice")


def _bench_report() -> dict:
    args = argparse.Namespace(
        model=None,
        device="cpu",
        dtype="auto",
        kv_layout="last_exited",
        per_task=PER_TASK,
        train_size=40000,
        thresholds=[0.5],
        write_lm_eval_data=None,
        speculative_tokens=None,
        draft_loops=2,
        quantization=None,
        kv_cache_dtype="auto",
    )
    return run(args)


def _mean(by_task: dict[str, float]) -> float:
    return sum(by_task[task] for task in TASKS) / len(TASKS)


@pytest.fixture(scope="module")
def bench() -> dict:
    return _bench_report()


def test_the_dataset_is_the_benchmarks_problems(bench):
    """The committed jsonl holds exactly the problems and choices the benchmark scores."""
    from vllm_rlt.models.load import model_folder
    from vllm_rlt.training.data import held_out, training_set

    record = json.loads((model_folder(None) / "training_record.json").read_text())
    train_size = record["args"]["train_size"]
    sets = {task: held_out(task, PER_TASK, training_set(task, train_size)) for task in TASKS}
    lines = [json.loads(line) for line in DATA.read_text().splitlines()]
    assert lines == documents(sets)


def test_lm_eval_against_the_server_equals_bench_accuracy(bench, tmp_path):
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "vllm_rlt.entrypoints.cli", "serve", "--port", str(port)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),
    }
    try:
        wait_healthy(url, server)
        model_args = (
            f"base_url={url}/v1/completions,model=ouro-tasks,tokenizer_backend=remote,"
            "num_concurrent=4,max_retries=1"
        )
        command = [
            sys.executable,
            "-m",
            "lm_eval",
            "run",
            "--model",
            "local-completions",
            "--model_args",
            model_args,
            "--include_path",
            "benchmarks/lm_eval",
            "--tasks",
            ",".join(TASK_NAMES),
            "--output_path",
            str(tmp_path / "out"),
        ]
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-4000:]
    finally:
        server.terminate()
        server.wait(timeout=60)
    [results_file] = list((tmp_path / "out").rglob("results_*.json"))
    results = json.loads(results_file.read_text())["results"]
    rows = {row["setting"]: row["exact_match"] for row in bench["rows"]}
    assert results["ouro_tasks_generate"]["exact_match,none"] == pytest.approx(
        _mean(rows["ouro q=0.5"]), abs=1e-9
    )
    assert results["ouro_tasks_generate_depth1"]["exact_match,none"] == pytest.approx(
        _mean(rows["depth 1"]), abs=1e-9
    )
    assert results["ouro_tasks_choice"]["acc,none"] == pytest.approx(
        _mean(bench["loglikelihood_accuracy"]), abs=1e-9
    )
    # Depth 1 gets some problems wrong, so the comparison above can tell a difference.
    assert 0.0 < _mean(rows["depth 1"]) < 1.0
