"""Same-run A/B of module constants: `vllm-rlt bench throughput` once per setting, in one
process on one machine, so a kernel switch or launch plan is compared without a second
start-up or a second machine. Prints one line per setting and writes every report.

python -m benchmarks.ab_constants --output ab.json \
    --set vllm_rlt.ops.triton_ops.FUSED_DECODE_ROWS=0,16 \
    -- --shape ouro-1.4b --device cuda --no-baseline --depth 4 --concurrency 1 8 64 256

Each --set names MODULE.CONSTANT=VALUE[,VALUE...] (Python literals); with several --set
flags every combination runs, in order. The constants must be read at call time (module
globals, not values copied at import).
"""

from __future__ import annotations

import ast
import contextlib
import importlib
import io
import itertools
import json
import os
import sys
import tempfile

from vllm_rlt.bench import throughput
from vllm_rlt.cli_parser import CLIParser


def _setting(text: str) -> tuple[object, str, list[object]]:
    """(module, constant name, values) from MODULE.CONSTANT=V1,V2,..."""
    target, _, values = text.partition("=")
    module_name, _, name = target.rpartition(".")
    if not module_name or not values:
        raise SystemExit(f"--set must be MODULE.CONSTANT=VALUE[,VALUE...], got {text!r}")
    module = importlib.import_module(module_name)
    if not hasattr(module, name):
        raise SystemExit(f"--set: {module_name} has no constant {name}")
    try:
        parsed = [ast.literal_eval(value) for value in values.split(",")]
    except (ValueError, SyntaxError) as exc:
        raise SystemExit(f"--set {text!r}: values must be Python literals ({exc})") from exc
    return module, name, parsed


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, bench = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    parser = CLIParser(prog="python -m benchmarks.ab_constants", description=__doc__)
    parser.add_argument("--set", action="append", required=True, help="MODULE.CONSTANT=V1,V2")
    parser.add_argument("--output", default=None, help="JSON of every report (default: none)")
    args = parser.parse_args(ours)
    settings = [_setting(text) for text in args.set]
    reports = []
    for values in itertools.product(*(values for _, _, values in settings)):
        label = {}
        for (module, name, _), value in zip(settings, values, strict=True):
            setattr(module, name, value)
            label[f"{module.__name__}.{name}"] = value
        handle, path = tempfile.mkstemp(suffix=".json")
        os.close(handle)
        with contextlib.redirect_stdout(io.StringIO()):
            throughput.main([*bench, "--output", path])
        with open(path) as file:
            report = json.load(file)
        os.unlink(path)
        reports.append({"constants": label, "report": report})
        figures = " ".join(
            f"c{r['concurrency']} {r['engine_median_decode_tokens_per_s']:.0f}"
            for r in report["results"]
        )
        print(json.dumps(label), figures, flush=True)
    if args.output:
        with open(args.output, "w") as file:
            json.dump(reports, file, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
