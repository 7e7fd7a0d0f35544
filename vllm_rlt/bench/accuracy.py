"""Task accuracy through the engine: exact match on held-out problems at fixed depths and
with the `ouro` exit policy at several thresholds, each with its mean loops per token.

    vllm-rlt bench accuracy --per-task 200                 # the built-in ouro-tasks model
    vllm-rlt bench accuracy --model path/to/trained --per-task 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any

from vllm_rlt.bench.report import emit_report
from vllm_rlt.engine.llm import LLM
from vllm_rlt.models.load import model_folder
from vllm_rlt.sampling_params import SamplingParams
from vllm_rlt.training.data import TASKS, held_out, training_set

THRESHOLDS = (0.3, 0.5, 0.7, 0.9)


def evaluate(llm: LLM, sets: dict[str, list], params: SamplingParams) -> dict[str, Any]:
    """Exact match per task and the mean loops of decode tokens, for one setting."""
    prompts = [prompt for task in TASKS for prompt, _ in sets[task]]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    result: dict[str, Any] = {"exact_match": {}, "mean_loops": None}
    depths: list[int] = []
    index = 0
    for task in TASKS:
        correct = 0
        for _, answer in sets[task]:
            completion = outputs[index].outputs[0]
            correct += completion.text == answer
            depths.extend(completion.exit_depths[1:])
            index += 1
        result["exact_match"][task] = correct / len(sets[task])
    result["mean_loops"] = statistics.fmean(depths) if depths else None
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    llm = LLM(model=args.model, device=args.device)
    record = model_folder(args.model) / "training_record.json"
    train_size = args.train_size
    if record.is_file():  # hold out exactly what this model was not trained on
        train_size = json.loads(record.read_text())["args"]["train_size"]
    sets = {task: held_out(task, args.per_task, training_set(task, train_size)) for task in TASKS}
    rows = []
    for depth in range(1, llm.engine.num_loops + 1):
        params = SamplingParams(max_tokens=12, temperature=0.0, max_loops=depth, exit_threshold=1.0)
        rows.append({"setting": f"depth {depth}", **evaluate(llm, sets, params)})
    for threshold in args.thresholds:
        params = SamplingParams(max_tokens=12, temperature=0.0, exit_threshold=threshold)
        rows.append({"setting": f"ouro q={threshold}", **evaluate(llm, sets, params)})
    return {
        "benchmark": "accuracy",
        "model": llm.model_name,
        "per_task": args.per_task,
        "train_size": train_size,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-rlt bench accuracy", description=__doc__)
    parser.add_argument("--model", default=None, help="folder (default: built-in ouro-tasks)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--per-task", type=int, default=200)
    parser.add_argument(
        "--train-size", type=int, default=40000, help="as in training (read from the record)"
    )
    parser.add_argument("--thresholds", type=float, nargs="+", default=list(THRESHOLDS))
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    report = run(args)
    emit_report(report, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
