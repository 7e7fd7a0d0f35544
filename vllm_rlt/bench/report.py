"""How every benchmark hands back its result: JSON on stdout, and a copy in --output."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile, the nearest sample (None without samples)."""
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def emit_report(report: dict[str, Any], output: str | None) -> None:
    text = json.dumps(report, indent=2)
    print(text)
    if output:
        with open(output, "w") as handle:
            handle.write(text + "\n")


def check_minimums(parser: argparse.ArgumentParser, args: argparse.Namespace, **least: int) -> None:
    """A one-line error for the first flag below its minimum (`concurrency` is a list)."""
    for name, minimum in least.items():
        value = getattr(args, name)
        value = min(value) if isinstance(value, list) else value
        if value < minimum:
            flag = name.replace("_", "-")
            parser.error(f"--{flag} must be >= {minimum}, got {value}")


def run_and_emit(
    parser: argparse.ArgumentParser,
    run: Callable[[argparse.Namespace], dict[str, Any]],
    args: argparse.Namespace,
) -> int:
    """Run a benchmark and print its report; a ValueError is a one-line error."""
    try:
        report = run(args)
    except ValueError as exc:
        parser.error(str(exc))
    emit_report(report, args.output)
    return 0
