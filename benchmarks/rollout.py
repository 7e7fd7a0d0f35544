"""An RL rollout as a vLLM user writes it: prompts of token ids, n samples each, long
outputs, temperature and top_p, through `LLM` with vLLM's argument names only. Prints one
JSON line per KV layout: output tokens/s, peak device memory while it runs (the weights and
the KV pool, planned to fill the device, included), preemptions, passes.

    python -m benchmarks.random_checkpoint ouro-1.4b ouro-random --device cuda
    python -m benchmarks.rollout ouro-random --device cuda
    python -m benchmarks.rollout ouro-random --device cuda --kv-layout last_exited shared_decode
    python -m benchmarks.rollout ouro-random --kv-layout shared_decode --kv-cache-dtype fp8

(defaults: 64 prompts of 256 tokens, n = 8, 4,096 output tokens, temperature 1.0, top_p 0.7)

`--time-limit S` stops each layout's rollout after S seconds, aborting what still runs, and
reports the tokens made until then ("complete": false): a whole rollout of the defaults
outlasts a short measurement window.
"""

from __future__ import annotations

import gc
import json
import platform
import random
import sys
import time

import torch
from tqdm import tqdm

from vllm_rlt import LLM, CacheConfig, SamplingParams
from vllm_rlt.cli_parser import CLIParser
from vllm_rlt.config import KV_CACHE_DTYPES, KV_LAYOUTS


def rollout(args, layout: str) -> dict:
    device = torch.device(args.device)
    llm = LLM(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
        skip_tokenizer_init=True,
        max_model_len=args.prompt_len + args.max_tokens,
        cache_config=CacheConfig(layout=layout, kv_cache_dtype=args.kv_cache_dtype),
    )
    vocab = llm.engine.model.config.vocab_size
    rng = random.Random(args.seed)
    prompts = [
        {"prompt_token_ids": [rng.randrange(vocab) for _ in range(args.prompt_len)]}
        for _ in range(args.num_prompts)
    ]
    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
        skip_special_tokens=False,
    )
    if device.type == "cuda":  # the peak from here on: weights, KV pool and the passes
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    if args.time_limit is None:
        outputs, complete = llm.generate(prompts, params), True
    else:
        outputs, complete = _generate_until(llm, prompts, params, start + args.time_limit)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    depths = [d for o in outputs for c in o.outputs for d in c.exit_depths[1:]]
    stats = llm.engine.stats()
    return {
        "kv_layout": layout,
        "kv_cache_dtype": args.kv_cache_dtype,
        "complete": complete,
        "output_tokens": tokens,
        "seconds": round(seconds, 2),
        "output_tokens_per_s": round(tokens / seconds, 1),
        "mean_depth": round(sum(depths) / len(depths), 3) if depths else None,
        "peak_memory_gib": (
            round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
            if device.type == "cuda"
            else None
        ),
        "kv_blocks": stats.num_blocks,
        "preemptions": stats.num_preemptions,
        "passes": stats.num_passes,
    }


def _generate_until(llm: LLM, prompts: list[dict], params: SamplingParams, deadline: float):
    """`llm.generate` through the engine's own loop, stopped at `deadline` (perf_counter):
    the outputs as they stand (unfinished requests aborted) and whether all had finished."""
    engine = llm.llm_engine
    ids = [f"rollout-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt["prompt_token_ids"], params)
    done = {}
    with tqdm(total=len(ids), desc="Generating", file=sys.stderr) as bar:
        while engine.has_unfinished and time.perf_counter() < deadline:
            for output in engine.step():
                if output.finished:
                    done[output.request_id] = output
                    bar.update(1)
    complete = len(done) == len(ids)
    for request_id in ids:
        if request_id not in done:
            done[request_id] = engine.abort_request(request_id)
    return [done[request_id] for request_id in ids], complete


def main(argv: list[str] | None = None) -> int:
    parser = CLIParser(prog="python -m benchmarks.rollout", description=__doc__)
    parser.add_argument("model", help="checkpoint folder or hub ID")
    parser.add_argument("--device", default="cuda", help="cuda or cpu")
    parser.add_argument("--dtype", default="bfloat16", help="the weights' dtype")
    parser.add_argument(
        "--kv-layout", nargs="+", default=["last_exited"], choices=KV_LAYOUTS, help="KV layouts run"
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="the K/V cache's dtype (fp8: float8 e4m3, half the bytes a pass reads)",
    )
    parser.add_argument("--num-prompts", type=int, default=64, help="prompts")
    parser.add_argument("--prompt-len", type=int, default=256, help="tokens per prompt")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max-tokens", type=int, default=4096, help="output tokens")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    parser.add_argument("--top-p", type=float, default=0.7, help="nucleus sampling")
    parser.add_argument(
        "--ignore-eos",
        action="store_true",
        help="run every sample to max_tokens (random weights may sample EOS early)",
    )
    parser.add_argument("--seed", type=int, default=0, help="prompts and sampling seed")
    parser.add_argument(
        "--time-limit",
        type=float,
        default=None,
        help="stop each layout's rollout after this many seconds (default: none, run it all)",
    )
    args = parser.parse_args(argv)
    parser.device(args.device)
    if args.time_limit is not None and not args.time_limit > 0:
        parser.error(f"--time-limit must be > 0 seconds, got {args.time_limit}")
    environment = {"python": platform.python_version(), "torch": torch.__version__}
    if torch.device(args.device).type == "cuda":
        environment["gpu"] = torch.cuda.get_device_name()
    command = "python -m benchmarks.rollout " + " ".join(sys.argv[1:] if argv is None else argv)
    for layout in args.kv_layout:
        record = rollout(args, layout)
        print(json.dumps({"command": command, "environment": environment, **record}), flush=True)
        gc.collect()  # the layout's engine, before the next one is sized to free memory
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
