"""Print the table of a `vllm-rlt bench accuracy` JSON in Markdown and, with --png, plot
accuracy against mean loops per token (needs matplotlib: `pip install -e ".[plot]"`).

python -m benchmarks.plot_accuracy accuracy.json --png accuracy.png   # in the repository root
python path/to/vllm-rlt/benchmarks/plot_accuracy.py accuracy.json      # anywhere else
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys

from vllm_rlt.cli_parser import CLIParser


def table(report: dict) -> str:
    tasks = list(report["rows"][0]["exact_match"])
    lines = [
        "| setting | mean loops per decode token | " + " | ".join(tasks) + " | mean |",
        "|---" * (len(tasks) + 3) + "|",
    ]
    for row in report["rows"]:
        scores = [row["exact_match"][task] for task in tasks]
        cells = " | ".join(f"{100 * s:.1f}" for s in scores)
        mean = 100 * statistics.fmean(scores)
        lines.append(f"| {row['setting']} | {row['mean_loops']:.2f} | {cells} | {mean:.1f} |")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.5), dpi=120)
    for prefix, style, label in (("depth", "o-", "fixed depth"), ("ouro", "s--", "trained gate")):
        rows = [r for r in report["rows"] if r["setting"].startswith(prefix)]
        loops = [r["mean_loops"] for r in rows]
        accuracy = [100 * statistics.fmean(r["exact_match"].values()) for r in rows]
        axis.plot(loops, accuracy, style, label=f"{label} (mean over tasks)")
        for index, (row, x, y) in enumerate(zip(rows, loops, accuracy, strict=True)):
            name = row["setting"].replace("ouro ", "")
            # Gate points cluster at few loops: stagger their labels upwards.
            offset = (4, -12) if prefix == "depth" else (-8, -26 - 9 * (index % 3))
            axis.annotate(name, (x, y), textcoords="offset points", xytext=offset, fontsize=7)
    axis.set_xlabel("mean loops per decode token")
    axis.set_ylabel("exact match (%)")
    axis.set_title(f"{report['model']}: held-out accuracy, {report['per_task']} problems per task")
    axis.set_ylim(0, 105)
    axis.grid(alpha=0.3)
    axis.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path)


def main(argv: list[str] | None = None) -> int:
    parser = CLIParser(prog="python -m benchmarks.plot_accuracy", description=__doc__)
    parser.add_argument("report", help="JSON written by `vllm-rlt bench accuracy --output`")
    parser.add_argument(
        "--png", default=None, help="also draw the plot into this file (default: table only)"
    )
    args = parser.parse_args(argv)
    if args.png and importlib.util.find_spec("matplotlib") is None:
        parser.error(
            '--png needs matplotlib, which the plot extra installs: pip install -e ".[plot]" '
            '(or pip install "vllm-rlt[plot]")'
        )
    try:
        with open(args.report, encoding="utf-8") as handle:
            report = json.load(handle)
    except OSError as exc:
        parser.error(f"cannot read {args.report}: {exc.strerror}")
    except ValueError as exc:  # not JSON, or not UTF-8
        parser.error(f"{args.report} is not JSON: {exc}")
    try:
        text = table(report)
    except (KeyError, TypeError, IndexError, AttributeError):
        parser.error(f"{args.report} is not a `vllm-rlt bench accuracy --output` report")
    print(text)
    if args.png:
        plot(report, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
