"""Same-run A/B of whole source trees: one `vllm-rlt` benchmark command run against each tree
in turn (a process per run, the tree first on PYTHONPATH), round after round with the order
rotated, so two versions of the package meet on one machine in one sitting. The first tree
is the reference; each figure is the median over the rounds, with its ratio to the
reference. A run may gain from its place in the round (in one served A/B on an H100 the
second run of a round served about 5% more): the report gives that effect, and a number of
rounds that is a multiple of the number of trees gives each tree every place equally
often. An older version is unpacked beside the working tree first, e.g.

mkdir -p ../base && git archive f2999c1 | tar -x -C ../base
python -m benchmarks.ab_trees --tree base=../base --tree new=. --rounds 4 --output ab.json \
    -- bench throughput --shape ouro-1.4b --device cuda --no-baseline --concurrency 1 8 64 256

The command must print a JSON report: `bench throughput`'s (the figure compared is each
row's median decode tokens/s, by concurrency) or `bench serve`'s (output tokens/s served, and
offline with `--compare-offline`). With `--output`, the file is rewritten after every run,
so a run stopped by a time limit keeps the medians of the runs it finished.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

from vllm_rlt.cli_parser import CLIParser


def _tree(text: str) -> tuple[str, Path]:
    """(name, folder) from NAME=DIR; the folder must hold a vllm_rlt package."""
    name, _, folder = text.partition("=")
    path = Path(folder).resolve()
    if not name or not folder:
        raise SystemExit(f"--tree must be NAME=DIR, got {text!r}")
    if not (path / "vllm_rlt" / "__init__.py").is_file():
        raise SystemExit(f"--tree {text!r}: {path} holds no vllm_rlt package")
    return name, path


def _run(folder: Path, command: list[str]) -> dict[str, Any]:
    """One run of `vllm-rlt COMMAND` with `folder`'s package; its JSON report."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [sys.executable, "-m", "vllm_rlt.entrypoints.cli", *command],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{folder}: vllm-rlt {' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)


def _figures(report: dict[str, Any]) -> dict[str, float]:
    """The figures one report gives, by name: median decode tokens/s per concurrency of
    `bench throughput`; output tokens/s served (and offline) of `bench serve`."""
    if "results" in report:
        return {
            str(row["concurrency"]): row["engine_median_decode_tokens_per_s"]
            for row in report["results"]
        }
    figures = {"served": report["output_tokens_per_s"]}
    if report.get("offline"):
        figures["offline"] = report["offline"]["output_tokens_per_s"]
    return figures


def order_effect(
    reports: dict[str, list[dict[str, Any]]], places: dict[str, list[int]]
) -> dict[str, float]:
    """Per figure, how a run later in its round compared with a run first in its round:
    each tree's median later over its median first, their geometric mean over the trees
    that ran in both places (none: no entry). Far from 1, the order biases a median that
    took the first place more or less often than the others did."""
    effects: dict[str, list[float]] = {}
    for name, runs in reports.items():
        for figure in _figures(runs[0]) if runs else ():
            first = [_figures(r)[figure] for r, p in zip(runs, places[name], strict=True) if p == 0]
            later = [_figures(r)[figure] for r, p in zip(runs, places[name], strict=True) if p > 0]
            if first and later and min(statistics.median(first), statistics.median(later)) > 0:
                ratio = statistics.median(later) / statistics.median(first)
                effects.setdefault(figure, []).append(ratio)
    return {figure: statistics.geometric_mean(ratios) for figure, ratios in effects.items()}


def summarize(
    trees: list[tuple[str, Path]],
    command: list[str],
    reports: dict[str, list[dict[str, Any]]],
    places: dict[str, list[int]] | None = None,
) -> dict[str, Any]:
    """Medians over the runs so far of every tree that has one, and their ratios to the
    reference (the first tree) where it has run; with `places` (each run's place in its
    round, 0 first), the order's effect too."""
    medians = {
        name: {
            figure: statistics.median(_figures(report)[figure] for report in runs)
            for figure in _figures(runs[0])
        }
        for name, runs in reports.items()
        if runs
    }
    reference = medians.get(trees[0][0], {})
    ratios = {
        name: {
            f: value / reference[f] if reference.get(f) else None for f, value in figures.items()
        }
        for name, figures in medians.items()
    }
    return {
        "command": ["vllm-rlt", *command],
        "trees": {name: str(folder) for name, folder in trees},
        "rounds": {name: len(runs) for name, runs in reports.items()},
        "medians": medians,
        "ratio_to_reference": ratios,
        "places": places or {},
        "order_effect": order_effect(reports, places) if places else {},
        "reports": reports,
    }


def compare(
    trees: list[tuple[str, Path]], command: list[str], rounds: int, output: Path | None = None
) -> dict[str, Any]:
    """Every tree's reports, round-robin with a rotated order, and the medians and ratios;
    `output` is rewritten after each run."""
    reports: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in trees}
    places: dict[str, list[int]] = {name: [] for name, _ in trees}
    with tqdm(total=rounds * len(trees), desc="A/B runs", file=sys.stderr) as progress:
        for round_index in range(rounds):
            shift = round_index % len(trees)
            for place, (name, folder) in enumerate(trees[shift:] + trees[:shift]):
                progress.set_postfix_str(name)
                reports[name].append(_run(folder, command))
                places[name].append(place)
                if output is not None:
                    summary = summarize(trees, command, reports, places)
                    output.write_text(json.dumps(summary, indent=1))
                progress.update()
    return summarize(trees, command, reports, places)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, command = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    parser = CLIParser(prog="python -m benchmarks.ab_trees", description=__doc__)
    parser.add_argument("--tree", action="append", required=True, help="NAME=DIR, twice or more")
    parser.add_argument("--rounds", type=int, default=3, help="runs per tree (default: 3)")
    parser.add_argument(
        "--output", default=None, help="JSON of every report, after each run (default: none)"
    )
    args = parser.parse_args(ours)
    trees = [_tree(text) for text in args.tree]
    if len(trees) < 2 or len({name for name, _ in trees}) != len(trees):
        parser.error("--tree: give two or more trees with distinct names")
    if not 1 <= args.rounds <= 100:
        parser.error(f"--rounds must be in [1, 100], got {args.rounds}")
    if not command:
        parser.error("give the vllm-rlt command after --, e.g. -- bench throughput ...")
    if args.rounds % len(trees):
        print(
            f"note: --rounds {args.rounds} is not a multiple of the {len(trees)} trees, so some "
            "tree runs first in its round more often than another; the JSON's order_effect "
            "says how much a later place gained",
            file=sys.stderr,
        )
    output = Path(args.output) if args.output else None
    result = compare(trees, command, args.rounds, output)
    for name, figures in result["medians"].items():
        ratios = result["ratio_to_reference"][name]
        line = "  ".join(
            f"{'c' + f if f.isdigit() else f} {value:,.0f} ({ratios[f]:.3f}x)"
            for f, value in figures.items()
        )
        print(f"{name}: {line}", file=sys.stderr)
    for figure, effect in result["order_effect"].items():
        print(f"a later place in the round, {figure}: {effect:.3f}x the first", file=sys.stderr)
    print(json.dumps({k: v for k, v in result.items() if k != "reports"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
