"""Prefill/decode handover cost: a `serve --disaggregate 1:1` server per KV layout, one
request at a time with prompts of the given lengths; from the server's /metrics, the K/V
bytes each handover moved, its time (offer to the decode core's copy), the bandwidth, and
the prompt blocks moved early (while later chunks ran, before the offer: their bytes count,
their time does not).
Prints one JSON line per (layout, prompt length).

    python -m benchmarks.random_checkpoint ouro-1.4b /tmp/ouro --device cuda
    python -m benchmarks.handover /tmp/ouro --prompt-len 1024 8192 -- --device cuda
    python -m benchmarks.handover toy --prompt-len 64 256 --requests 4    # on the CPU
"""

from __future__ import annotations

import json
import random
import re
import sys
import urllib.request

from tqdm import tqdm

from vllm_rlt.bench.serve_launch import launched
from vllm_rlt.cli_parser import CLIParser

METRICS = (
    "kv_transfer_bytes_total",
    "kv_transfer_seconds_sum",
    "kv_transfer_seconds_count",
    "kv_transfer_prefetched_blocks_total",
)


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"{url}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as reply:
        return json.load(reply)


def _transfer_totals(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=60) as reply:
        text = reply.read().decode()
    totals = {}
    for name in METRICS:
        found = re.search(rf"^vllm_rlt:{name} (\S+)$", text, re.M)
        totals[name] = float(found.group(1)) if found else 0.0
    return totals


def measure(args, layout: str, prompt_len: int, extra: list[str]) -> dict:
    info: dict = {}
    flags = [args.model, "--disaggregate", "1:1", "--kv-layout", layout, *extra]
    rng = random.Random(prompt_len)
    with launched(["vllm_rlt.entrypoints.cli", "serve"], flags, info) as url:
        model = json.load(urllib.request.urlopen(f"{url}/v1/models"))["data"][0]["id"]
        _post(url, {"model": model, "prompt": [5] * prompt_len, "max_tokens": 2})  # warm-up
        before = _transfer_totals(url)
        for _ in tqdm(range(args.requests), desc=f"{layout} {prompt_len}", file=sys.stderr):
            prompt = [rng.randrange(3, 250) for _ in range(prompt_len)]  # in every vocabulary
            _post(url, {"model": model, "prompt": prompt, "max_tokens": 2, "ignore_eos": True})
        after = _transfer_totals(url)
    moved = {name: after[name] - before[name] for name in METRICS}
    count = moved["kv_transfer_seconds_count"] or 1.0
    seconds = moved["kv_transfer_seconds_sum"]
    return {
        "kv_layout": layout,
        "prompt_len": prompt_len,
        "handovers": int(moved["kv_transfer_seconds_count"]),
        "bytes_per_handover": moved["kv_transfer_bytes_total"] / count,
        "seconds_per_handover": seconds / count,
        "gb_per_s": moved["kv_transfer_bytes_total"] / seconds / 1e9 if seconds else None,
        # whole prompt blocks moved while later chunks ran, before the handover's seconds
        "prefetched_blocks_per_handover": moved["kv_transfer_prefetched_blocks_total"] / count,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = CLIParser(prog="python -m benchmarks.handover", description=__doc__)
    parser.add_argument("model", help="checkpoint folder, hub ID or a built-in model")
    parser.add_argument("--prompt-len", type=int, nargs="+", default=[1024, 8192])
    parser.add_argument("--requests", type=int, default=16, help="timed requests per point")
    parser.add_argument(
        "--kv-layout", nargs="+", default=["last_exited", "shared_decode"], help="layouts"
    )
    args = parser.parse_args(own)
    for length in args.prompt_len:
        if length < 1:
            parser.error(f"--prompt-len must be >= 1, got {length}")
    if args.requests < 1:
        parser.error(f"--requests must be >= 1, got {args.requests}")
    for layout in args.kv_layout:
        for length in args.prompt_len:
            print(json.dumps(measure(args, layout, length, extra)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
