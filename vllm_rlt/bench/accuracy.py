"""Task accuracy through the engine: exact match on held-out problems at fixed depths and
with the model's own exit policy (Ouro's gate, Huginn's latent convergence) at several
thresholds, each with its mean loops per token; and
multiple-choice accuracy by loglikelihood (the right answer against three other problems'
answers, scored with the prompt logprobs of the full-depth prefill).

    vllm-rlt bench accuracy --per-task 200                 # the built-in ouro-tasks model
    vllm-rlt bench accuracy --model path/to/trained --per-task 200
    vllm-rlt bench accuracy --kv-layout shared --thresholds 0.5 0.9
    vllm-rlt bench accuracy --per-task 20 --write-lm-eval-data tasks.jsonl

The last writes the same problems and choices as an lm-evaluation-harness dataset (see
benchmarks/lm_eval/), so lm-eval against `vllm-rlt serve` can be checked against this report.

Each setting shows a progress bar over its prompts on stderr; the JSON report goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from functools import partial
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from vllm_rlt.bench.report import emit_report
from vllm_rlt.cli_parser import CLIParser
from vllm_rlt.config import KV_CACHE_DTYPES, KV_LAYOUTS, QUANTIZATIONS, CacheConfig
from vllm_rlt.entrypoints.args import add_speculation_args, speculative_config
from vllm_rlt.sampling_params import SamplingParams
from vllm_rlt.training.data import TASKS, held_out, training_set

if TYPE_CHECKING:  # the engine (and torch) loads when a run starts, not to parse flags
    from vllm_rlt.engine.llm import LLM

# Default thresholds by the model's exit policy: Ouro's gate q, Huginn's relative change.
THRESHOLDS = {"ouro": (0.3, 0.5, 0.7, 0.9), "latent_diff": (0.3, 0.1, 0.03, 0.01)}
NUM_CHOICES = 4


def documents(sets: dict[str, list]) -> list[dict[str, Any]]:
    """One record per problem: its task, prompt, answer, and the answer among three wrong
    ones (the next distinct answers of the same task's problems), the right one first."""
    records = []
    for task in TASKS:
        answers = [answer for _, answer in sets[task]]
        for index, (prompt, answer) in enumerate(sets[task]):
            choices = [answer]
            for other in answers[index + 1 :] + answers[:index]:
                if len(choices) == NUM_CHOICES:
                    break
                if other not in choices:
                    choices.append(other)
            records.append(
                {"task": task, "prompt": prompt, "answer": answer, "choices": choices, "label": 0}
            )
    return records


def loglikelihood_accuracy(llm: LLM, records: list[dict[str, Any]]) -> dict[str, float]:
    """Per task, how often the right choice has the highest summed logprob of its tokens
    after the prompt (ties go to the earlier choice), tokenized as lm-eval does: the
    continuation is what encoding prompt + choice adds to the prompt's own tokens."""
    tokenizer = llm.get_tokenizer()
    prompts, spans = [], []
    for record in records:
        context = tokenizer.encode(record["prompt"], add_special_tokens=False)
        for choice in record["choices"]:
            whole = tokenizer.encode(record["prompt"] + choice, add_special_tokens=False)
            prompts.append(whole)
            spans.append(len(context))
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    bar = partial(tqdm, desc="loglikelihood", file=sys.stderr)
    outputs = llm.generate(prompts, params, use_tqdm=bar)
    scores = []
    for ids, start, output in zip(prompts, spans, outputs, strict=True):
        entries = output.prompt_logprobs
        assert entries is not None
        scores.append(sum(entries[p][ids[p]].logprob for p in range(start, len(ids))))  # type: ignore[index]
    correct: dict[str, list[bool]] = {task: [] for task in TASKS}
    start = 0
    for record in records:  # fewer choices when a task has fewer distinct answers
        own = scores[start : start + len(record["choices"])]
        start += len(own)
        correct[record["task"]].append(own.index(max(own)) == record["label"])
    return {task: sum(hits) / len(hits) for task, hits in correct.items() if hits}


def write_lm_eval_data(records: list[dict[str, Any]], path: str) -> None:
    with open(path, "w", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps(record) + "\n")


def evaluate(
    llm: LLM, sets: dict[str, list], params: SamplingParams, setting: str
) -> dict[str, Any]:
    """Exact match per task and the mean loops of decode tokens, for one setting."""
    prompts = [prompt for task in TASKS for prompt, _ in sets[task]]
    bar = partial(tqdm, desc=setting, file=sys.stderr)
    before = llm.stats()
    outputs = llm.generate(prompts, params, use_tqdm=bar)
    after = llm.stats()
    result: dict[str, Any] = {"setting": setting, "exact_match": {}, "mean_loops": None}
    drafted = after["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
    if drafted:  # self-speculation ran (fixed-depth settings deeper than the draft)
        accepted = after["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
        result["spec_acceptance_rate"] = accepted / drafted
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
    from vllm_rlt.engine.llm import LLM
    from vllm_rlt.models.load import model_folder

    llm = LLM(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        cache_config=CacheConfig(layout=args.kv_layout, kv_cache_dtype=args.kv_cache_dtype),
        speculative_config=speculative_config(args),
        quantization=args.quantization,
    )
    record = model_folder(args.model) / "training_record.json"
    train_size = args.train_size
    if record.is_file():  # hold out exactly what this model was not trained on
        train_size = json.loads(record.read_text())["args"]["train_size"]
    sets = {task: held_out(task, args.per_task, training_set(task, train_size)) for task in TASKS}
    records = documents(sets)
    if args.write_lm_eval_data:
        write_lm_eval_data(records, args.write_lm_eval_data)
    rows = []
    for depth in range(1, llm.engine.num_loops + 1):  # fixed under every exit policy
        params = SamplingParams(max_tokens=12, temperature=0.0, min_loops=depth, max_loops=depth)
        rows.append(evaluate(llm, sets, params, f"depth {depth}"))
    policy = llm.engine.model.exit_policy
    for exit_threshold in args.thresholds or THRESHOLDS.get(policy, ()):
        params = SamplingParams(max_tokens=12, temperature=0.0, exit_threshold=exit_threshold)
        rows.append(evaluate(llm, sets, params, f"{policy} q={exit_threshold}"))
    return {
        "benchmark": "accuracy",
        "model": llm.model_name,
        "kv_layout": args.kv_layout,
        "quantization": args.quantization,
        "kv_cache_dtype": args.kv_cache_dtype,
        "speculative_tokens": args.speculative_tokens,
        "draft_loops": args.draft_loops if args.speculative_tokens is not None else None,
        "device": str(llm.engine.model.device),
        "dtype": str(llm.engine.model.dtype).removeprefix("torch."),
        "per_task": args.per_task,
        "train_size": train_size,
        "rows": rows,
        "loglikelihood_accuracy": loglikelihood_accuracy(llm, records),
    }


def main(argv: list[str] | None = None) -> int:
    parser = CLIParser(prog="vllm-rlt bench accuracy", description=__doc__)
    parser.add_argument(
        "--model",
        default=None,
        help="checkpoint folder or built-in name (default: the built-in ouro-tasks)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument(
        "--dtype", default="auto", help="auto, float32, bfloat16 or float16 (auto: bf16 on CUDA)"
    )
    parser.add_argument(
        "--kv-layout", choices=KV_LAYOUTS, default="last_exited", help="KV cache layout"
    )
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        default=None,
        help="fp8: the layer projections in float8 with a scale per output channel (default: none)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="K/V storage: auto (the model's dtype) or float8 (fp8 = fp8_e4m3, fp8_e5m2)",
    )
    parser.add_argument("--per-task", type=int, default=200, help="held-out problems per task")
    parser.add_argument(
        "--train-size",
        type=int,
        default=40000,
        help="training problems per task, held out from the test set; the model's "
        "training_record.json overrides it",
    )
    parser.add_argument(
        "--thresholds",
        type=float,
        nargs="+",
        default=None,
        help="exit thresholds of the model's own policy, one setting each (default: "
        + "; ".join(f"{name}: {' '.join(map(str, qs))}" for name, qs in THRESHOLDS.items())
        + ")",
    )
    parser.add_argument(
        "--output", default=None, help="also write the JSON report here (default: stdout only)"
    )
    add_speculation_args(parser)
    parser.add_argument(
        "--write-lm-eval-data",
        default=None,
        metavar="PATH",
        help="also write the problems and choices as an lm-eval jsonl dataset (default: no)",
    )
    args = parser.parse_args(argv)
    if args.per_task < 1:
        parser.error(f"--per-task must be >= 1, got {args.per_task}")
    try:
        report = run(args)
    except (ValueError, FileNotFoundError) as exc:
        parser.error(str(exc))
    emit_report(report, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
