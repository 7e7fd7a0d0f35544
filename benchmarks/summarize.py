"""Print a one-line-per-result table of throughput JSON files (for benchmark records)."""

import json

from vllm_rlt.cli_parser import CLIParser

parser = CLIParser(prog="python -m benchmarks.summarize", description=__doc__)
parser.add_argument("reports", nargs="+", help="JSON files of `vllm-rlt bench throughput`")
for path in parser.parse_args().reports:
    with open(path) as handle:
        report = json.load(handle)
    workload = report["workload"]
    for result in report["results"]:
        engine = result["engine"]
        line = (
            f"{path.rsplit('/', 1)[-1]:<28} c={result['concurrency']:<3} "
            f"decode={engine['decode_tokens_per_s']:9.1f} tok/s  "
            f"tpot={1000 * (engine['tpot_s_mean'] or 0):7.2f} ms  "
            f"loops={engine['mean_loops']}"
        )
        if "baseline" in result:
            line += (
                f"  naive={result['baseline']['decode_tokens_per_s']:8.1f}"
                f"  ratio={result['decode_ratio_vs_baseline']:.2f}"
            )
        if "roofline" in result:
            line += f"  roofline={result['roofline']['fraction_achieved']:.2f}"
        flags = (workload.get("cuda_graphs"), workload.get("async_scheduling"))
        print(line, f"P{workload['prompt_len']}/O{workload['output_len']}", flags)
