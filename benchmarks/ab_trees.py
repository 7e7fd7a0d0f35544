"""Same-run A/B of whole source trees: one `vllm-rlt` benchmark command run against each tree
in turn (a process per run, the tree first on PYTHONPATH), round after round with the order
rotated, so two versions of the package meet on one machine in one sitting. The first tree
is the reference; each figure is the median over the rounds, with its ratio to the
reference. An older version is unpacked beside the working tree first, e.g.

mkdir -p ../base && git archive f2999c1 | tar -x -C ../base
python -m benchmarks.ab_trees --tree base=../base --tree new=. --rounds 3 --output ab.json \
    -- bench throughput --shape ouro-1.4b --device cuda --no-baseline --concurrency 1 8 64 256

The command must print a JSON report with `results` rows that carry `concurrency` (as
`bench throughput` does); the figure compared is each row's median decode tokens/s.
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


def _figures(report: dict[str, Any]) -> dict[int, float]:
    """Median decode tokens/s per concurrency of one report."""
    return {
        row["concurrency"]: row["engine_median_decode_tokens_per_s"] for row in report["results"]
    }


def compare(trees: list[tuple[str, Path]], command: list[str], rounds: int) -> dict[str, Any]:
    """Every tree's reports, round-robin with a rotated order, and the medians and ratios."""
    reports: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in trees}
    with tqdm(total=rounds * len(trees), desc="A/B runs", file=sys.stderr) as progress:
        for round_index in range(rounds):
            shift = round_index % len(trees)
            for name, folder in trees[shift:] + trees[:shift]:
                progress.set_postfix_str(name)
                reports[name].append(_run(folder, command))
                progress.update()
    medians = {
        name: {
            concurrency: statistics.median(_figures(report)[concurrency] for report in runs)
            for concurrency in _figures(runs[0])
        }
        for name, runs in reports.items()
    }
    reference = medians[trees[0][0]]
    ratios = {
        name: {c: value / reference[c] if reference[c] else None for c, value in figures.items()}
        for name, figures in medians.items()
    }
    return {
        "command": ["vllm-rlt", *command],
        "trees": {name: str(folder) for name, folder in trees},
        "rounds": rounds,
        "median_decode_tokens_per_s": medians,
        "ratio_to_reference": ratios,
        "reports": reports,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, command = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    parser = CLIParser(prog="python -m benchmarks.ab_trees", description=__doc__)
    parser.add_argument("--tree", action="append", required=True, help="NAME=DIR, twice or more")
    parser.add_argument("--rounds", type=int, default=3, help="runs per tree (default: 3)")
    parser.add_argument("--output", default=None, help="JSON of every report (default: none)")
    args = parser.parse_args(ours)
    trees = [_tree(text) for text in args.tree]
    if len(trees) < 2 or len({name for name, _ in trees}) != len(trees):
        parser.error("--tree: give two or more trees with distinct names")
    if not 1 <= args.rounds <= 100:
        parser.error(f"--rounds must be in [1, 100], got {args.rounds}")
    if not command:
        parser.error("give the vllm-rlt command after --, e.g. -- bench throughput ...")
    result = compare(trees, command, args.rounds)
    for name, figures in result["median_decode_tokens_per_s"].items():
        ratios = result["ratio_to_reference"][name]
        line = "  ".join(f"c{c} {value:,.0f} ({ratios[c]:.3f}x)" for c, value in figures.items())
        print(f"{name}: {line}", file=sys.stderr)
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "reports"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
