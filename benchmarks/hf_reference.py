"""Decode throughput of a Huginn-0125 checkpoint under its own public modeling code
(`RavenForCausalLM`, `raven_modeling_minimal.py` from the model's Hugging Face folder, run
by `transformers` with trust_remote_code), for the engine's "x times the reference" figure
on the same weights. The checkpoint folder may be one that `benchmarks.random_checkpoint
huginn-3.5b` wrote: the modeling files are linked in beside its weights, in a scratch
folder, with the `auto_map` that transformers needs. Greedy, batched, fixed depth
(`num_steps`), the reference's default K/V cache; decode tokens/s counts the tokens after
each row's first over the time past a one-token run of the same batch, as `vllm-rlt bench
throughput` counts them. The modeling file is written for transformers 4.x (4.56 runs it).

python -m benchmarks.hf_reference huginn-3.5b-random --modeling-dir raven/ --concurrency 8
vllm-rlt bench throughput --shape huginn-3.5b --device cuda --no-baseline --concurrency 8 \\
    --prompt-len 64 --output-len 256 --depth 32      # the engine, the same weights
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from vllm_rlt.cli_parser import CLIParser

MODELING_FILES = ("raven_modeling_minimal.py", "raven_config_minimal.py")
AUTO_MAP = {
    "AutoConfig": "raven_config_minimal.RavenConfig",
    "AutoModelForCausalLM": "raven_modeling_minimal.RavenForCausalLM",
}


def reference_folder(checkpoint: Path, modeling_dir: Path, scratch: Path) -> Path:
    """A folder transformers loads with trust_remote_code: the checkpoint's files linked,
    the modeling files linked, config.json with AUTO_MAP."""
    for name in os.listdir(checkpoint):  # a Hub folder ships the modeling files too
        if name != "config.json" and name not in MODELING_FILES:
            (scratch / name).symlink_to((checkpoint / name).resolve())
    for name in MODELING_FILES:
        (scratch / name).symlink_to((modeling_dir / name).resolve())
    config = json.loads((checkpoint / "config.json").read_text())
    (scratch / "config.json").write_text(json.dumps({**config, "auto_map": AUTO_MAP}))
    return scratch


def _timed_generate(model, ids: torch.Tensor, new_tokens: int, steps: int) -> float:
    """Seconds of one greedy generate of `new_tokens` tokens a row (EOS ignored)."""
    if ids.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            num_steps=steps,
            use_cache=True,
            pad_token_id=0,
        )
    if ids.is_cuda:
        torch.cuda.synchronize()
    if out.shape[1] != ids.shape[1] + new_tokens:
        raise SystemExit(f"the reference gave {out.shape[1] - ids.shape[1]} tokens a row")
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = CLIParser(prog="python -m benchmarks.hf_reference", description=__doc__)
    parser.add_argument("checkpoint", help="a Huginn-0125 folder (config.json, safetensors)")
    parser.add_argument(
        "--modeling-dir",
        required=True,
        help="folder holding the model's raven_modeling_minimal.py and raven_config_minimal.py",
    )
    parser.add_argument("--device", default="cuda", help="cuda or cpu (default: cuda)")
    parser.add_argument("--dtype", default="bfloat16", help="torch dtype (default: bfloat16)")
    parser.add_argument("--concurrency", type=int, default=8, help="rows (default: 8)")
    parser.add_argument("--prompt-len", type=int, default=64, help="tokens a prompt (default: 64)")
    parser.add_argument("--output-len", type=int, default=256, help="tokens a row (default: 256)")
    parser.add_argument("--num-steps", type=int, default=32, help="recurrences (default: 32)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs (default: 3)")
    parser.add_argument("--seed", type=int, default=0, help="prompt seed (default: 0)")
    parser.add_argument("--output", default=None, help="also write the JSON here (default: none)")
    args = parser.parse_args(argv)
    for name in ("concurrency", "prompt_len", "num_steps", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.output_len < 2:
        parser.error(f"--output-len must be >= 2 (decode follows a token), got {args.output_len}")
    checkpoint, modeling_dir = Path(args.checkpoint), Path(args.modeling_dir)
    if not (checkpoint / "config.json").is_file():
        parser.error(f"{checkpoint} holds no config.json")
    missing = [name for name in MODELING_FILES if not (modeling_dir / name).is_file()]
    if missing:
        parser.error(f"--modeling-dir {modeling_dir} lacks {', '.join(missing)}")
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        parser.error(f"--dtype must name a torch dtype, got {args.dtype!r}")
    device = parser.device(args.device)
    try:
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError:
        parser.error("it needs transformers (4.x runs the reference's modeling file)")

    with tempfile.TemporaryDirectory() as scratch:
        folder = reference_folder(checkpoint, modeling_dir, Path(scratch))
        model = AutoModelForCausalLM.from_pretrained(
            folder, trust_remote_code=True, torch_dtype=dtype
        )
    if model.dtype != dtype:
        raise SystemExit(f"the reference loaded in {model.dtype}, not {dtype}")
    model = model.to(device).eval()
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(1, vocab, (args.concurrency, args.prompt_len), generator=gen)
    ids = ids.to(device)
    _timed_generate(model, ids, 2, args.num_steps)  # warm-up
    firsts, wholes = [], []
    for _ in tqdm(range(args.repeats), desc="reference runs", file=sys.stderr):
        firsts.append(_timed_generate(model, ids, 1, args.num_steps))
        wholes.append(_timed_generate(model, ids, args.output_len, args.num_steps))
    decode_s = statistics.median(wholes) - statistics.median(firsts)
    decode_tokens = args.concurrency * (args.output_len - 1)
    report = {
        "benchmark": "hf_reference",
        "command": " ".join(["python -m benchmarks.hf_reference", *sys.argv[1:]]),
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        },
        "workload": {
            "concurrency": args.concurrency,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "num_steps": args.num_steps,
            "dtype": args.dtype,
        },
        "first_token_s": firsts,
        "whole_run_s": wholes,
        "decode_tokens_per_s": decode_tokens / max(decode_s, 1e-9),
        "end_to_end_tokens_per_s": args.concurrency * args.output_len / statistics.median(wholes),
    }
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
